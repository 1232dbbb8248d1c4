"""A verifiers v1 multi-turn environment, built with verifiers' own classes for the tests.

The v1 form of a `MultiTurnEnv`: the package ships its own `vf.Env` whose `run` holds the
rollout open (`Interaction`) and answers each model turn, as `env_response` did; verifiers loads
it because the taskset's package exports it. Installed for the tests by putting this folder on
the path (as `pip install` would) and loaded by its id, `vf-retry`.
"""

from vf_retry.env import RetryEnv, RetryTaskset

__all__ = ["RetryEnv", "RetryTaskset"]
