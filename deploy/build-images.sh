#!/usr/bin/env bash
# Builds meshrl's CPU image (meshrl:cpu, every role) and, offline, a Redis image, with or without a registry.
#
#   deploy/build-images.sh            # offline when no registry answers, else the Dockerfile's public base
#   deploy/build-images.sh --offline  # base image from Debian packages (debootstrap), wheels fetched on the host
#   deploy/build-images.sh --online   # plain `docker build` on python:3.11-slim-bookworm, redis from the registry
#   add --no-cache to build without Docker's layer cache (the base tarball and the wheels are still reused)
#
# Offline, nothing comes from an image registry and the build containers reach no network:
#   - meshrl-base:bookworm: `debootstrap --variant=minbase` of Debian bookworm (python3, venv, redis-server)
#     from this machine's own apt mirror, imported with `docker import`;
#   - wheels: `pip download` on the host for the image's Python (torch CPU + meshrl's dependencies),
#     installed with --no-index;
#   - meshrl-redis:bookworm: the base with Debian's redis-server as its command.
# Cached between builds under $MESHRL_CACHE (default /var/cache/meshrl, else ~/.cache/meshrl): the base's
# root file system as a tarball (re-imported in seconds after `docker rmi`), and the wheel folder (refreshed
# when pyproject.toml or the torch version changes). Compose picks the Redis image from deploy/.env.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=--auto
NO_CACHE=()   # --no-cache: Docker's layer cache unused (the base tarball and the wheel folder still are)
for arg in "$@"; do
  case "$arg" in
    --offline|--online|--auto) MODE=$arg ;;
    --no-cache) NO_CACHE=(--no-cache) ;;
    *) echo "usage: $0 [--offline|--online] [--no-cache]" >&2; exit 2 ;;
  esac
done
IMAGE=${MESHRL_IMAGE:-meshrl:cpu}
BASE_IMAGE=meshrl-base:bookworm
REDIS_IMAGE=meshrl-redis:bookworm
PYTHON_IMAGE=python:3.11-slim-bookworm
TORCH_VERSION=2.13.0
PY=${PYTHON:-python3}
# Where the offline build names its images for Compose (deploy/.env is read by `docker compose -f deploy/...`).
ENV_FILE=${MESHRL_ENV_FILE:-deploy/.env}
if [ -z "${MESHRL_CACHE:-}" ]; then
  MESHRL_CACHE=/var/cache/meshrl
  mkdir -p "$MESHRL_CACHE" 2>/dev/null && [ -w "$MESHRL_CACHE" ] || MESHRL_CACHE=$HOME/.cache/meshrl
fi
mkdir -p "$MESHRL_CACHE"
say() { echo "build-images: $*" >&2; }

if [ "$MODE" = --auto ]; then
  if timeout 30 docker pull -q "$PYTHON_IMAGE" >/dev/null 2>&1; then MODE=--online; else
    say "no image registry answers (docker pull $PYTHON_IMAGE failed): building offline"; MODE=--offline; fi
fi

# The Debian mirror this machine's apt uses (MESHRL_DEBIAN_MIRROR overrides).
debian_mirror() {
  if [ -n "${MESHRL_DEBIAN_MIRROR:-}" ]; then echo "$MESHRL_DEBIAN_MIRROR"; return; fi
  local m
  m=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
      | grep -E '^(URIs:|deb )' | grep -v security | grep -oE 'https?://[^ ]*/debian/?' | head -1 || true)
  echo "${m:-http://deb.debian.org/debian}"
}

base_image() {
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && { say "$BASE_IMAGE: present"; return; }
  local tarball=$MESHRL_CACHE/base-bookworm.tar
  if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null || { say "debootstrap is missing: apt-get install debootstrap"; exit 1; }
    local root mirror
    root=$(mktemp -d "$MESHRL_CACHE/rootfs.XXXX"); mirror=$(debian_mirror)
    say "debootstrap bookworm from $mirror (a few minutes, once)"
    debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates,redis-server \
      bookworm "$root" "$mirror" >"$MESHRL_CACHE/debootstrap.log" 2>&1 \
      || { say "debootstrap failed; see $MESHRL_CACHE/debootstrap.log"; rm -rf "$root"; exit 1; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
    rm -rf "$root"
  fi
  say "$BASE_IMAGE: docker import $tarball"
  docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' "$tarball" "$BASE_IMAGE" >/dev/null
}

wheels() {
  # Wheels for the image's own Python (bookworm's 3.11.2, whatever the host runs: markers such as
  # python_full_version < "3.11.3" then pick what the image needs), binary only, for its glibc.
  local dir=$MESHRL_CACHE/wheels pyver reqs stamp
  pyver=$(docker run --rm --network none "$BASE_IMAGE" python3 -c 'import platform; print(platform.python_version())')
  reqs=$(mktemp)
  # bookworm's glibc is 2.36: every manylinux tag up to that (pip takes them as given, one flag each)
  local platforms="--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux2010_x86_64"
  for v in $(seq 5 36); do platforms+=" --platform manylinux_2_${v}_x86_64"; done
  { echo "torch==$TORCH_VERSION"; echo "setuptools>=68"; echo wheel
    $PY -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))'
  } >"$reqs"
  # refreshed when the requirements or the image's Python change
  stamp="python $pyver $(sha256sum <"$reqs" | cut -c1-64)"
  if [ -f "$dir/.stamp" ] && [ "$(cat "$dir/.stamp")" = "$stamp" ]; then
    say "wheels: cached in $dir"; rm -f "$reqs"; return
  fi
  say "wheels: pip download for Python $pyver into $dir"
  mkdir -p "$dir"
  download() {
    $PY -m pip download -q --disable-pip-version-check -d "$dir" --only-binary=:all: --python-version "$pyver" \
      --implementation cp --abi cp311 --abi abi3 --abi none $platforms "$@" \
      2> >(grep -v "is neither a file nor a directory" >&2)
  }
  download -r "$reqs"
  # pip evaluates markers with the host's interpreter (3.11.7 skips `python_full_version < "3.11.3"` ones), so
  # the image's own pip resolves against the folder, offline, and each requirement it misses is fetched.
  local missing
  for _ in $(seq 20); do
    missing=$(docker run --rm --network none -v "$dir:/wheels:ro" -v "$reqs:/reqs.txt:ro" "$BASE_IMAGE" sh -c \
      'python3 -m venv /tmp/v && /tmp/v/bin/pip install -q --dry-run --no-index --find-links /wheels -r /reqs.txt' \
      2>&1 | sed -n 's/.*No matching distribution found for \([^;]*\).*/\1/p' | head -1 || true)
    [ -z "$missing" ] && break
    say "wheels: the image also needs $missing"
    download "$missing"
  done
  [ -z "$missing" ] || { say "wheels: still missing $missing after 20 rounds"; exit 1; }
  rm -f "$reqs"
  echo "$stamp" >"$dir/.stamp"
}

# The build context as a tar stream: exactly what the Dockerfile copies, the cached wheels as deploy/wheels/.
context() {
  tar -c --exclude=__pycache__ --exclude='*.pyc' pyproject.toml README.md protos services coordinator examples \
    deploy/docker/Dockerfile deploy/compose_run.py deploy/wheels/README.md \
    -C "$MESHRL_CACHE" --transform 's,^wheels,deploy/wheels,' --exclude=.stamp wheels
}

redis_image() {
  docker image inspect "$REDIS_IMAGE" >/dev/null 2>&1 && { say "$REDIS_IMAGE: present"; return; }
  say "$REDIS_IMAGE: Debian's redis-server on $BASE_IMAGE"
  docker build -q -t "$REDIS_IMAGE" - >/dev/null <<DOCKERFILE
FROM $BASE_IMAGE
RUN mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
DOCKERFILE
}

start=$(date +%s)
if [ "$MODE" = --online ]; then
  docker build "${NO_CACHE[@]}" -f deploy/docker/Dockerfile -t "$IMAGE" .
  rm -f "$ENV_FILE"
else
  base_image
  wheels
  redis_image
  say "$IMAGE: docker build on $BASE_IMAGE with --no-index wheels"
  context | docker build "${NO_CACHE[@]}" -f deploy/docker/Dockerfile --build-arg "PYTHON_IMAGE=$BASE_IMAGE" -t "$IMAGE" -
  # Compose reads deploy/.env: the Redis image built here instead of the registry's.
  printf 'MESHRL_REDIS_IMAGE=%s\nMESHRL_IMAGE=%s\n' "$REDIS_IMAGE" "$IMAGE" >"$ENV_FILE"
fi
say "done in $(( $(date +%s) - start )) s: $IMAGE$([ "$MODE" = --offline ] && echo ", $REDIS_IMAGE ($ENV_FILE names it)")"
