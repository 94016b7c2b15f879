#!/usr/bin/env bash
# A Python base image for deploy/docker/Dockerfile.cpu made from Debian packages alone, for hosts
# that reach a Debian mirror but no image registry (python:3.11-slim cannot be pulled there).
#
#   tools/build_base_image.sh [TAG]        (default TAG: specstream-base:bookworm; needs root)
#
# debootstrap writes a minimal Debian root filesystem with python3 (3.11 on bookworm),
# python3-venv and ca-certificates; `docker import` turns it into an image. Then:
#   make image PYTHON_IMAGE=specstream-base:bookworm
#
# Environment: SUITE (default bookworm), MIRROR (default: debootstrap's own), DOCKER (default
# docker). Unlike python:3.11-slim this base has no /usr/local/bin/python, only Debian's python3,
# which is what the Dockerfile calls.
set -euo pipefail

tag="${1:-specstream-base:bookworm}"
suite="${SUITE:-bookworm}"
docker="${DOCKER:-docker}"

for tool in debootstrap "$docker"; do
  command -v "$tool" >/dev/null || { echo "$0: $tool not found (Debian: apt-get install debootstrap docker.io)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "$0: debootstrap needs root" >&2; exit 1; }

root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT

start=$(date +%s)
# shellcheck disable=SC2086  # MIRROR is one optional word
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  "$suite" "$root" ${MIRROR:-}
# What a container never needs: package lists, caches, docs. apt itself stays, so images built
# on this base can still install packages.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
       "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*

tar --numeric-owner -C "$root" -c . | "$docker" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  --message "debootstrap --variant=minbase $suite + python3, python3-venv, ca-certificates" \
  - "$tag"
echo "$tag: built in $(( $(date +%s) - start )) s"
