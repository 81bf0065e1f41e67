#!/usr/bin/env bash
# Before a lent GPU run, on this (networked) machine: the wheels check.sh needs that the lent machines lack.
# They have torch, Lightning, pytest and numpy, but no FairScale and no network. FairScale is pure Python.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: -d .whl "fairscale==0.4.13" 2>/dev/null ||
    python3 -m pip wheel --quiet --no-deps -w .whl "fairscale==0.4.13"
ls -l .whl
