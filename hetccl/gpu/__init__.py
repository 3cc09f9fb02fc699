"""Device memory operations: device buffers (torch CUDA/ROCm tensors, CuPy arrays, __cuda_array_interface__,
DLPack), streams and stream-ordered completion, device reductions, the vendor CCL communicators of an island
(NCCL, RCCL), staging through host memory and the zero-copy link between two leaders. Nothing here knows the
communicators above it: the engine (group.py) and the hierarchical schedule (hierarchical.py) call in and hand
over what is needed."""
