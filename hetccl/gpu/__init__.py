"""GPU support: device buffers (torch CUDA/ROCm tensors, CuPy arrays, __cuda_array_interface__, DLPack),
stream-ordered completion, vendor-CCL islands (NCCL, RCCL) and the host-staged cross-island path."""
