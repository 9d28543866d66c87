#!/usr/bin/env bash
# E2B's own Python SDK test suite (tests/sync and tests/async of e2b-dev/E2B at an SDK
# release) against this machine's dsec, the way issue 41 measures E2B parity:
#
#   make up                     # a local cluster (the E2B front end on 127.0.0.1:7130)
#   scripts/e2b-suite.sh        # fetch, install, run; prints pytest's summary
#
# Settings (environment):
#   E2B_SUITE_VERSION   the SDK release whose tests run (default 2.45.1: the tag
#                       @e2b/python-sdk@<version> of e2b-dev/E2B, and e2b==<version> from PyPI)
#   E2B_SUITE_DIR       where the repository and the venv go (default /tmp/dsec-e2b-suite)
#   E2B_SUITE_URL       the front end (default http://127.0.0.1:7130)
#   E2B_SUITE_WORKERS   pytest-xdist workers (default 3)
#   E2B_SUITE_REPO      the repository to clone (default https://github.com/e2b-dev/E2B)
#   E2B_SUITE_SRC       a checkout of it at that tag to use instead of cloning
# Arguments go to pytest (e.g. -k snapshot, or test paths instead of tests/sync tests/async).
#
# The front end should give E2B's default network (DSEC_COMPAT_DEFAULT_NETWORK=open when the
# cluster starts), as the suite expects sandboxes to reach the internet by default. The
# suite's tests that need the internet, a Docker registry or public sandbox ports fail where
# those are missing; README ("E2B's own test suite") lists them.
set -euo pipefail

version=${E2B_SUITE_VERSION:-2.45.1}
dir=${E2B_SUITE_DIR:-/tmp/dsec-e2b-suite}
url=${E2B_SUITE_URL:-http://127.0.0.1:7130}
workers=${E2B_SUITE_WORKERS:-3}
repo_url=${E2B_SUITE_REPO:-https://github.com/e2b-dev/E2B}
tag="@e2b/python-sdk@$version"
here=$(cd "$(dirname "$0")/.." && pwd)

log() { printf 'e2b-suite: %s\n' "$*" >&2; }
die() {
    log "$*"
    exit 1
}

mkdir -p "$dir"
src=${E2B_SUITE_SRC:-$dir/E2B-$version}
if [[ ! -d $src/packages/python-sdk/tests ]]; then
    [[ -z ${E2B_SUITE_SRC:-} ]] || die "$E2B_SUITE_SRC has no packages/python-sdk/tests"
    log "cloning $repo_url at $tag"
    rm -rf "$src.tmp"
    git clone --quiet --depth 1 --branch "$tag" "$repo_url" "$src.tmp" ||
        die "cannot clone $repo_url at $tag"
    mv "$src.tmp" "$src"
fi
venv="$dir/venv-$version"
if [[ ! -x $venv/bin/pytest ]]; then
    log "making $venv (e2b==$version and the suite's test tools)"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet "e2b==$version" "pytest>=9,<10" "pytest-xdist>=3.3,<4" \
        "python-dotenv>=1,<2" "pytest-dotenv>=0.5.2,<0.6" "pytest-asyncio>=1.3,<2" \
        "pytest-timeout>=2.4,<3" || die "pip install failed"
fi

curl -sS -o /dev/null "$url/" ||
    die "no E2B front end answers at $url: start a cluster first (make up)"
key=$("$here/.venv/bin/python" -m dsecctl token create "e2b-suite-$(date +%s)" --agent --e2b |
    head -n 1)
[[ $key == e2b_* ]] || die "could not make an E2B-shaped token (dsec token create --e2b)"

cd "$src/packages/python-sdk"
args=("$@")
((${#args[@]})) || args=(tests/sync tests/async)
log "running E2B's suite ($tag) against $url with $workers workers"
E2B_API_URL=$url E2B_SANDBOX_URL=$url E2B_API_KEY=$key E2B_DOMAIN=localhost \
    "$venv/bin/pytest" -n "$workers" -q -p no:cacheprovider --timeout 180 -rfE \
    --junitxml="$dir/result-$version.xml" "${args[@]}"
