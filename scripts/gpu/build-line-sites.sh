#!/usr/bin/env bash
# Builds .gpu-lines/: the sites of several Unsloth stacks of unsloth_adaptive_kl/versions.py for the
# GPU machine, small enough to be carried in one call (64 MiB), for the `unsloth-line` stage of
# scripts/gpu/verify.sh (issue 21: the fixed-vs-dynamic β graph count on every Unsloth line).
#
#   bash scripts/gpu/build-line-sites.sh                       # unsloth-2026.8 unsloth-2026.9 unsloth-2026.10
#   bash scripts/gpu/build-line-sites.sh unsloth-2026.8 ...    # some of them
#
# Like scripts/gpu/build-site.sh these sites hold bitsandbytes (its CUDA 13 library only): the 16-bit
# LoRA run needs it too, since unsloth_zoo's patching imports it in FastLanguageModel.from_pretrained
# ("Unsloth: Please install bitsandbytes", every line, H100, 2026-11-24). They are layered so that
# what stacks share is carried once:
#   .gpu-lines/common/             what every stack needs that the GPU machine lacks (Liger, tyro, ...)
#   .gpu-lines/<trl>[+<transformers>+...]/  a stack's pinned TRL, datasets and, where it is not the
#                                  machine's 5.17.0, transformers (with the tokenizers and huggingface_hub
#                                  a 4.x needs)
#   .gpu-lines/<unsloth line>/     unsloth and unsloth_zoo of that stack
# each packed as NAME.tgz when over PACK_OVER_MB unpacked (default 0: all; the three lines measured 80 MB
# unpacked, 30 MB packed, 2026-11-24; transformers 4.57.6 alone is 57 MB unpacked).
# and .gpu-lines/paths.sh, which the stage sources: `line_path STACK` prints the PYTHONPATH of a stack
# (unpacking its packed layers under /tmp first). On the GPU machine, carry .gpu-lines and run
#   bash scripts/gpu/verify.sh $OUT unsloth-lines
# Keep .gpu-lines out of git (it is in .gitignore).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=.gpu-lines
MACHINE_TRANSFORMERS=transformers==5.17.0  # what the GPU machine has (/work/shared/gpu/README.md)
PACK_OVER_MB=${PACK_OVER_MB:-0}
[ $# -gt 0 ] || set -- unsloth-2026.8 unsloth-2026.9 unsloth-2026.10
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
COMMON_PKGS="liger-kernel==0.8.5 bitsandbytes==0.50.2 dill==0.4.0 multiprocess==0.70.18 xxhash tyro docstring-parser shtab typeguard msgspec
cut_cross_entropy pydantic pydantic-core annotated-types typing-inspection json5 nest-asyncio structlog"

layer() {  # layer NAME PKG...: download the wheels and unpack them into $DEST/NAME, trimmed
  local name=$1 whl
  shift
  whl=$(mktemp -d)
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps $PLAT -d "$whl" "$@"
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-deps --no-compile $PLAT --target "$DEST/$name" "$whl"/*.whl
  rm -rf "$whl" "$DEST/$name"/studio "$DEST/$name"/unsloth_cli "$DEST/$name"/bin
  find "$DEST/$name" -name '__pycache__' -prune -exec rm -rf {} +
  [ ! -d "$DEST/$name/bitsandbytes" ] || find "$DEST/$name/bitsandbytes" -name 'libbitsandbytes_cuda*.so' ! -name '*cuda130.so' -delete
}

pack_if_large() {  # pack_if_large NAME: NAME.tgz instead of NAME/ when the folder is over PACK_OVER_MB
  local name=$1
  if [ "$(du -sm "$DEST/$name" | cut -f1)" -gt "$PACK_OVER_MB" ]; then
    tar czf "$DEST/$name.tgz" -C "$DEST" "$name" && rm -rf "${DEST:?}/$name"
  fi
}

rm -rf "$DEST"
mkdir -p "$DEST"
# shellcheck disable=SC2086
layer common $COMMON_PKGS
pack_if_large common
{
  echo "# Sourced by scripts/gpu/verify.sh (stage unsloth-lines); written by scripts/gpu/build-line-sites.sh."
  echo "LINES_DIR=\$(cd \"\$(dirname \"\${BASH_SOURCE[0]}\")\" && pwd)"
  echo "LINES=\"$*\""
  echo "unpack() { [ -d \"\$LINES_DIR/\$1\" ] && { echo \"\$LINES_DIR/\$1\"; return; }; mkdir -p /tmp/gpu-lines; [ -d /tmp/gpu-lines/\$1 ] || tar xzf \"\$LINES_DIR/\$1.tgz\" -C /tmp/gpu-lines; echo /tmp/gpu-lines/\$1; }"
  echo "line_path() {"
  echo "  case \$1 in"
} > "$DEST/paths.sh"
for stack in "$@"; do
  pins=$(python3 unsloth_adaptive_kl/versions.py "$stack" | sed -n 1p)
  nodeps=$(python3 unsloth_adaptive_kl/versions.py "$stack" | sed -n 2p)
  [ -n "$nodeps" ] || { echo "$stack has no Unsloth: not a line" >&2; exit 2; }
  own=()  # the stack's pins that the machine and the common layer lack
  for pin in $pins; do
    case $pin in liger-kernel==*|"$MACHINE_TRANSFORMERS") ;; *) own+=("$pin") ;; esac
  done
  case " $pins " in *" datasets=="*) ;; *) own+=(datasets==4.8.5) ;; esac
  case " $pins " in *" transformers==4."*) own+=(tokenizers==0.22.2 huggingface_hub==0.36.2) ;; esac  # what transformers 4.57 accepts
  pin_layer=$(tr ' ' '+' <<< "${own[*]}" | sed 's/==/-/g')
  [ -e "$DEST/$pin_layer" ] || [ -e "$DEST/$pin_layer.tgz" ] || { layer "$pin_layer" "${own[@]}"; pack_if_large "$pin_layer"; }
  # shellcheck disable=SC2086
  layer "$stack" $nodeps
  pack_if_large "$stack"
  echo "    $stack) echo \"\$(unpack $stack):\$(unpack $pin_layer):\$(unpack common)\" ;;" >> "$DEST/paths.sh"
done
{
  echo "    *) echo \"no site for \$1 in \$LINES_DIR\" >&2; return 1 ;;"
  echo "  esac"
  echo "}"
} >> "$DEST/paths.sh"
du -sh "$DEST"/* | sort -k2
du -sh "$DEST"
du -sh --apparent-size "$DEST"
