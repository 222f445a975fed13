# Source on the GPU host from the project root, after the .stage parts arrived:
#     source tests/gpu/gpu_env.sh
# = the vLLM bundle (.stage/c2/unpack.sh: /tmp/site, /tmp/models, vLLM flags) + the extras of
# tests/gpu/prepare_extras.sh (redis-server on PATH, redis-py / pydantic-settings on PYTHONPATH)
# + the project on PYTHONPATH. NVLink multicast stays off (never set NCCL_NVLS_ENABLE=1).
source .stage/c2/unpack.sh || return $?
if [ ! -x /tmp/extras/bin/redis-server ]; then
  mkdir -p /tmp/stage
  [ -f .stage/c3/extras.tar.gz ] && cp -f .stage/c3/extras.tar.gz /tmp/stage/
  tar -xzf /tmp/stage/extras.tar.gz -C /tmp || { echo "extras missing"; return 6; }
fi
export PATH=/tmp/extras/bin:$PATH
export PYTHONPATH=$PWD:/tmp/extras/site:$PYTHONPATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export ROLLOUTPOOL_GPU=1
redis-server --version | head -1
