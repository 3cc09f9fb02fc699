"""What CUDA's eager module loading costs a process (the stream order across islands needs it): seconds from
`import torch` to a first kernel's result, and the device memory in use then (free memory before/after, so run
it alone on the GPU). Run it once per mode, alternating:

    for m in EAGER LAZY EAGER LAZY; do CUDA_MODULE_LOADING=$m python3 benchmarks/eager_loading_cost.py; done
"""

import os
import time

t0 = time.perf_counter()
import torch  # noqa: E402

x = torch.ones(1 << 20, device="cuda")
(x * 2).sum().item()
t1 = time.perf_counter()
free, total = torch.cuda.mem_get_info()
print(f"{os.environ.get('CUDA_MODULE_LOADING')}: first kernel after {t1 - t0:.2f} s, device memory in use "
      f"{(total - free) / 2**20:.0f} MiB", flush=True)
