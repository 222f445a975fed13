#!/bin/bash
# Extras the GPU host lacks for the project's GPU runs, next to the vLLM bundle of
# ../shared/gpu/prepare.sh: a redis-server binary (with the shared libraries it links that a
# CUDA image may miss), the pure-Python wheels redis-py, pydantic-settings, python-dotenv, and
# orjson (the pool's JSON responses).
# Run on a machine with package access and a redis-server, from the project root:
#     bash tests/gpu/prepare_extras.sh [OUTDIR=.stage]      -> OUTDIR/c3/extras.tar.gz (~5 MB)
# Keep OUTDIR git-ignored. On the host, tests/gpu/gpu_env.sh unpacks it.
set -euo pipefail
OUT=$(mkdir -p "${1:-.stage}/c3" && cd "${1:-.stage}/c3" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/extras/bin" "$WORK/extras/lib" "$WORK/extras/site" "$WORK/whl"
EXE=$(command -v redis-server)
cp -L "$EXE" "$WORK/extras/bin/redis-server.real"
# every linked library except the C runtime itself (taken from the host)
ldd "$EXE" | awk '/=> \//{print $3}' | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so.*|libm.so.*|ld-linux*|libstdc++.so.*|libgcc_s.so.*|libpthread.so.*|libdl.so.*) ;;
    *) cp -L "$lib" "$WORK/extras/lib/" ;;
  esac
done
cat > "$WORK/extras/bin/redis-server" <<'SH'
#!/bin/sh
# the bundled libraries apply to redis-server alone, never to Python / vLLM
HERE=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH="$HERE/../lib" exec "$HERE/redis-server.real" "$@"
SH
chmod +x "$WORK/extras/bin/redis-server"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$WORK/whl" redis==8.1.0 pydantic-settings==2.16.3 python-dotenv==1.2.4 orjson==3.13.0
for w in "$WORK"/whl/*.whl; do (cd "$WORK/extras/site" && unzip -q -o "$w"); done
tar -C "$WORK" -czf "$OUT/extras.tar.gz" extras
du -sh "$OUT/extras.tar.gz"
