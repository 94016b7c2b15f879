#!/bin/sh
# `pip install "$@"` inside an image build: Dockerfile.cpu bind-mounts deploy/docker/ at /build and
# runs every pip install through this script, which is never copied into an image. It adds what a
# build behind a proxy or away from the public indexes needs:
# - the BuildKit secret `ca` (docker build --secret id=ca,src=FILE): PEM CAs that pip trusts
#   besides its own bundle, for this one command: the secret is never written to a layer;
# - deploy/docker/wheels/ as pip's --find-links, so that a wheel put there (a CPU torch wheel, say)
#   installs without an index.
# The index itself comes from pip's own variables, PIP_INDEX_URL and PIP_EXTRA_INDEX_URL, which
# the Dockerfile declares as build arguments.
set -eu
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -s /run/secrets/ca ]; then
  bundle="$(mktemp)"
  trap 'rm -f "$bundle"' EXIT
  cat "$(python3 -c 'import pip._vendor.certifi as c; print(c.where())')" /run/secrets/ca > "$bundle"
  export PIP_CERT="$bundle" REQUESTS_CA_BUNDLE="$bundle"
fi
python3 -m pip install --find-links "$(dirname "$0")/wheels" "$@"
