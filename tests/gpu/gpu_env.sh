# Source on the GPU host from the project root, after the .stage parts arrived:
#     source tests/gpu/gpu_env.sh
# = the vLLM bundle (.stage/c2/unpack.sh: /tmp/site, /tmp/models, vLLM flags) + the extras of
# tests/gpu/prepare_extras.sh (redis-server on PATH, redis-py / pydantic-settings on PYTHONPATH)
# + the project on PYTHONPATH + TRL (tests/gpu/prepare_trl.sh) where it travelled. NVLink
# multicast stays off (never set NCCL_NVLS_ENABLE=1).
source .stage/c2/unpack.sh || return $?
if [ ! -x /tmp/extras/bin/redis-server ]; then
  mkdir -p /tmp/stage
  [ -f .stage/c3/extras.tar.gz ] && cp -f .stage/c3/extras.tar.gz /tmp/stage/
  tar -xzf /tmp/stage/extras.tar.gz -C /tmp || { echo "extras missing"; return 6; }
fi
export PATH=/tmp/extras/bin:$PATH
export PYTHONPATH=$PWD:/tmp/extras/site:$PYTHONPATH
# TRL and the dependencies the host lacks (tests/gpu/prepare_trl.sh), for the parts that came:
# each unpacks once into /tmp/trl/site-packages (a part copied to /tmp/stage by an earlier call
# counts). The directory must be named site-packages: dill (datasets' fingerprints) pickles
# modules from anywhere else by value, and fails on pyarrow's.
for part in pyarrow trl; do
  [ -f "/tmp/trl/site-packages/.$part" ] && continue
  f=$(ls .stage/c*/$part.tar.xz /tmp/stage/$part.tar.xz 2>/dev/null | head -1)
  [ -n "$f" ] && mkdir -p /tmp/trl && tar -xJf "$f" -C /tmp/trl && touch "/tmp/trl/site-packages/.$part"
done
[ -d /tmp/trl/site-packages ] && export PYTHONPATH=$PYTHONPATH:/tmp/trl/site-packages
