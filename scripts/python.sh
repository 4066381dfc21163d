# Sourced (not run) by the scripts: sets and exports PYTHON, the interpreter Hourglass is
# installed into and run with. Call it from the repository root.
#   PYTHON set already          that one (nothing is decided here)
#   HOURGLASS_VENV=1            .venv/bin/python, the project's virtual environment
#   HOURGLASS_VENV=0            python3 itself, even when it is externally managed
#   python3 externally managed  .venv/bin/python: a stock Debian 12 or Ubuntu 24.04 python3
#                               refuses `pip install` (PEP 668, an EXTERNALLY-MANAGED file)
#   .venv/bin/python exists     .venv/bin/python (made by an earlier run)
#   otherwise                   python3, as before
# scripts/setup.sh creates .venv when PYTHON points into it and it does not exist yet.
# HOURGLASS_BASE_PYTHON (default python3) is the interpreter that decides and makes the venv.
HOURGLASS_VENV_DIR=$PWD/.venv
HOURGLASS_BASE_PYTHON=${HOURGLASS_BASE_PYTHON:-python3}
if [ -z "${PYTHON:-}" ]; then
  if [ "${HOURGLASS_VENV:-}" = 1 ] || { [ "${HOURGLASS_VENV:-}" != 0 ] && { [ -x "$HOURGLASS_VENV_DIR/bin/python" ] \
      || "$HOURGLASS_BASE_PYTHON" -c 'import os, sys, sysconfig  # PEP 668: a venv is never externally managed
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if sys.prefix == sys.base_prefix and os.path.exists(marker) else 1)' 2>/dev/null; }; }
  then
    PYTHON=$HOURGLASS_VENV_DIR/bin/python
  else
    PYTHON=$HOURGLASS_BASE_PYTHON
  fi
  export PYTHON HOURGLASS_BASE_PYTHON
fi
