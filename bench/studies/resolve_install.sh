#!/usr/bin/env bash
# Does requirements.txt resolve from the package index alone on Linux, macOS and Windows?
# Resolves (does not install) for each platform with uv's cross-platform resolver, Python 3.11,
# wheels only, ignoring any pip configuration or local wheel folder on this machine.
#   bash bench/studies/resolve_install.sh [requirements files...]   (default: requirements.txt)
# Needs `uv` (pip install uv; a checking tool, not a dependency of minscope). Exit 1 if any fails.
set -uo pipefail
cd "$(dirname "$0")/../.."
reqs=("${@:-requirements.txt}")
uv=${UV:-uv}
fail=0
for target in x86_64-manylinux_2_28 aarch64-manylinux_2_28 aarch64-apple-darwin x86_64-pc-windows-msvc; do
    out=$(env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u UV_INDEX_URL -u UV_EXTRA_INDEX_URL \
          MACOSX_DEPLOYMENT_TARGET=14.0 "$uv" pip compile --no-config \
          --python-platform "$target" --python-version 3.11 --only-binary :all: \
          "${reqs[@]}" 2>&1)
    if [ $? -eq 0 ]; then
        echo "$target: resolves ($(echo "$out" | grep -E '^(torch|triton)==' | tr '\n' ' '))"
    else
        echo "$target: FAILS"; echo "$out" | sed 's/^/    /' | tail -5; fail=1
    fi
done
exit $fail
