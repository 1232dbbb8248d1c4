# Shell functions the install scripts share (sourced, not run).
#
# Extra environments. Some parts cannot share the environment relayrl was installed into (a
# framework with conflicting pins, a server with its own torch, a tool that needs another Python),
# so they get a venv of their own next to the checkout (.venv-camel, .venv-vllm, ...). Each follows
# the same pattern, so that it works whatever that environment is (a venv, conda, the system
# interpreter):
#   1. its own interpreter, isolated: never --system-site-packages, which exposes the *base*
#      interpreter's packages, not those of a venv relayrl may be in;
#   2. everything it imports installed into it explicitly, the rest in one pip call so that pip
#      resolves every pin together (relayrl itself from this checkout, editable, when it imports
#      relayrl);
#   3. a stamp file holding that install's spec: a re-run whose spec is unchanged does nothing.
# Its script's header says what the venv holds and why; a variable names its folder and PYTHON the
# interpreter it is made from (`python_for 3.12` where the tool needs that version).
#
#   extra_venv_ready VENV STAMP SPEC  true when VENV was finished for exactly SPEC
#   extra_venv_create VENV PYTHON     an isolated venv; an existing one is kept unless it sees
#                                     outside site-packages or its interpreter is gone
#   extra_venv_done VENV STAMP SPEC   record SPEC as finished
#   python_for X.Y                    the interpreter of Python X.Y: pythonX.Y when it runs, else
#                                     pyenv's (whose shim fails for a version not selected)
#   install_torch PYTHON VERSION      torch==VERSION into PYTHON's environment, the CPU build where
#                                     there is one; an installed torch of that version (any build,
#                                     a CUDA one included) is kept

PIP_QUIET=(--quiet --disable-pip-version-check)

extra_venv_ready() {
  [ -x "$1/bin/python" ] && [ -f "$1/$2" ] && [ "$(cat "$1/$2")" = "$3" ]
}

extra_venv_create() {
  local venv=$1 py=$2
  if "$venv/bin/python" -c '' 2>/dev/null \
      && ! grep -qiE '^include-system-site-packages *= *true' "$venv/pyvenv.cfg"; then
    return 0
  fi
  echo "creating $venv with $py"
  "$py" -m venv --clear "$venv"
}

extra_venv_done() {
  printf '%s' "$3" > "$1/$2"
}

python_for() {
  local c
  for c in "python$1" "${PYENV_ROOT:-$HOME/.pyenv}/versions/$1".*/bin/"python$1"; do
    if "$c" -c '' 2>/dev/null; then
      echo "$c"
      return 0
    fi
  done
  echo "no Python $1 here (python$1 on PATH, or under pyenv)" >&2
  return 1
}

install_torch() {
  local py=$1 version=$2 have
  have=$("$py" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
  if [ "${have%%+*}" = "$version" ]; then
    return 0
  fi
  # PyPI's Linux wheels of torch are CUDA builds (several GB of nvidia-* packages); the CPU build
  # is torch==VERSION+cpu, on PyTorch's own index (or wherever pip is configured to look first).
  # Where neither has it (no such build for this Python or platform), PyPI's build.
  "$py" -m pip install "${PIP_QUIET[@]}" "torch==$version+cpu" 2>/dev/null && return 0
  "$py" -m pip install "${PIP_QUIET[@]}" "torch==$version+cpu" \
    --index-url https://download.pytorch.org/whl/cpu 2>/dev/null && return 0
  echo "no CPU build torch==$version+cpu for $("$py" -V) here: installing PyPI's torch==$version"
  "$py" -m pip install "${PIP_QUIET[@]}" "torch==$version"
}
