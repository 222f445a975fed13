#!/bin/bash
# TRL 1.16 and the dependencies the GPU host lacks, for the TRL run on the GPU host
# (python -m bench.trl_grpo --gpu): two parts that travel alone, next to the vLLM bundle of
# ../shared/gpu/prepare.sh and the extras of tests/gpu/prepare_extras.sh.
# Run on a machine with package access, from the project root:
#     bash tests/gpu/prepare_trl.sh [OUTDIR=.stage]
#       -> OUTDIR/c4/pyarrow.tar.xz (~30 MB: pyarrow without Flight, S3, headers and tests)
#       -> OUTDIR/c5/trl.tar.xz     (~10 MB: trl, accelerate, datasets, pandas and theirs, and
#          what rolloutpool itself imports beyond tests/gpu/prepare_extras.sh: orjson, click,
#          rich)
# The host already has torch, transformers, huggingface_hub, numpy, psutil, pyyaml, jinja2.
# Keep OUTDIR git-ignored. On the host, tests/gpu/gpu_env.sh unpacks them when present.
set -euo pipefail
OUTDIR=$(mkdir -p "${1:-.stage}" && cd "${1:-.stage}" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$WORK/whl" \
  trl==1.16.0 accelerate==1.15.0 datasets==5.2.0 pyarrow==26.0.1 pandas==3.1.1 \
  dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.9.0 python-dateutil==4.0.0 \
  six==1.17.0 tzdata==2026.1 orjson==3.13.0 click==8.5.1 rich==15.0.0 markdown-it-py==4.3.0 \
  mdurl==0.1.2 pygments==2.21.0 2>&1 | grep -v "is ignored" || true
mkdir -p "$WORK/pa/site-packages" "$WORK/rest/site-packages"
(cd "$WORK/pa/site-packages" && unzip -q -o "$WORK"/whl/pyarrow-*.whl)
# what datasets never loads: Flight, S3, the C++ tests, headers and sources
(cd "$WORK/pa/site-packages/pyarrow" && rm -rf include src tests \
  libarrow_flight.so.* _flight.*.so libarrow_python_flight.so* libarrow_s3.so.* _s3fs.*.so \
  _pyarrow_cpp_tests.*.so)
for w in "$WORK"/whl/*.whl; do
  case "$(basename "$w")" in pyarrow-*) ;; *) (cd "$WORK/rest/site-packages" && unzip -q -o "$w") ;; esac
done
mkdir -p "$OUTDIR/c4" "$OUTDIR/c5"
tar -C "$WORK/pa" -cJf "$OUTDIR/c4/pyarrow.tar.xz" site-packages
tar -C "$WORK/rest" -cJf "$OUTDIR/c5/trl.tar.xz" site-packages
du -sh "$OUTDIR/c4/pyarrow.tar.xz" "$OUTDIR/c5/trl.tar.xz"
