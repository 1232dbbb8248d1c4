"""A small verifiers v1 environment package, built with verifiers' own classes for the tests.

No environment package on PyPI installs and runs offline, so the tests install this one (its
folder goes on sys.path, as `pip install` would put it on site-packages) and load it by its id,
`vf-addition`, the way verifiers loads any installed environment.
"""

from vf_addition.taskset import AdditionTaskset

__all__ = ["AdditionTaskset"]
