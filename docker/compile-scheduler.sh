#!/bin/sh
# The scheduler's decision path compiled with mypyc (scheduler/native.py) in an image's build stage, into
# the venv's installed copy of Baton. gcc, the Python headers and mypy are installed for this step only;
# the image's last stage copies the venv, extension modules included, and none of the build tools.
#   sh docker/compile-scheduler.sh [VENV]     (default /opt/baton/venv)
set -eu
VENV=${1:-/opt/baton/venv}
apt-get update
apt-get install -y --no-install-recommends gcc libc6-dev python3-dev
rm -rf /var/lib/apt/lists/*
"$VENV/bin/pip" install --target /opt/mypyc "mypy>=1.10" setuptools
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PYTHONPATH=/opt/mypyc "$VENV/bin/python" -m scheduler.native "$SITE"
rm -rf /opt/mypyc
