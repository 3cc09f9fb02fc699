"""RDMA verbs transport (pyverbs): one reliable-connected queue pair per peer, SEND/RECV with credits.

Connection set-up. Every rank opens one RDMA device (HETCCL_IB_DEVICE, else the first device with an
active port), one protection domain, one completion queue with a completion channel, and a TCP listener.
Per peer, the higher rank dials; both sides run the job-secret HMAC handshake (purpose "verbs") and then
exchange their connection data as msgpack control frames over that authenticated socket: QP number, a random
24-bit PSN, GID (RoCE v2) or LID (InfiniBand), path MTU and the slot geometry. A QP is moved to RTR with the
peer's QPN, PSN and address, so it accepts packets from that one QP only. The socket stays open as the
liveness channel: EOF or an error on it is the peer's death (`ctx.on_peer_lost`), exactly like the TCP
transport's reader, so a rank that vanishes while nothing is in flight towards it is still noticed at once.

Data path. Each QP has S + K receive slots of B bytes in one registered region (S = HETCCL_IB_SLOTS data
slots, K = control slots, B = HETCCL_IB_SLOT_BYTES), all posted as receive work requests. A message is cut
into fragments of at most one slot; each fragment is one SEND whose first 8 bytes are a fragment header
(kind, and the sender's cumulative count of receive slots it has freed: the credit return, piggybacked on
every message). The first fragment also carries the 48-byte data header (fingerprint, tag, size), so
matching and mismatch detection are the core's (`hetccl.matching.Matcher`, from `ctx.new_matcher`).
- Credits: a sender may have at most S data fragments that the receiver has not yet freed; it waits for
  credits (with the deadline) beyond that. When no reverse traffic carries the credits, the receiver sends
  a credit-only message (into one of the K control slots, which are re-posted as soon as they arrive).
- Several fragments are in flight per peer (up to S) and several messages per endpoint.
- Send side: payloads of at least HETCCL_IB_REG_MIN bytes are sent straight from the user's memory, which
  is registered once and kept in a registration cache (keyed by the buffer's owning object, dropped when
  that object is garbage-collected); smaller payloads, and memory that cannot be registered, are copied into
  pre-registered bounce buffers. `send` returns when the NIC has completed every fragment.
- Receive side: fragments land in the receive slots and are copied, or reduced, straight into the posted
  receive's destination; data that arrives before its receive waits in the matcher's bounded early buffer
  (when that is full, slots are not freed and the credits stop the sender).
- Completions: one completion queue per transport, with a completion channel whose file descriptor is
  watched by the event loop (`loop.add_reader`); the handler acknowledges the events, re-arms the CQ and
  polls it empty. No spinning.
- Errors: a failed work completion (QP error, retry exceeded, flush), a broken liveness socket or a deadline
  fails the endpoint with PeerLostError / CollectiveTimeout and reports the peer lost, so every rank ends
  with a HetcclError.

GPU memory: `register_memory` registers device buffers through dma-buf (CUDA `cuMemGetHandleForAddressRange`
then `ibv_reg_dmabuf_mr`); where that is impossible it logs once and returns None, and device buffers go
through host staging (the GPU layer's staged path).

Layout (one small module each, like Gloo's ibverbs transport folder): `loader` (importing pyverbs), `device`
(listing and opening RDMA devices), `memory` (the host registration cache), `dmabuf` (device memory
registration), `frames` (the fragment header and numbering), `endpoint` (one peer's queue pair: set-up,
credits, send, receive, failure), `transport` (VerbsTransport: availability, listening, connecting, the
completion queue).
"""

from .device import NO_DEVICE, Device, device_names
from .dmabuf import CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, cuda_dmabuf_fd, device_range, register_device_buffer
from .endpoint import VerbsEndpoint
from .frames import CTRL_SLOTS, FRAG, FRAG_CREDIT, FRAG_FIRST, FRAG_NEXT, HDR_FIRST, SEND_WR_BASE
from .loader import SYSTEM_SITE_DIRS, pyverbs
from .memory import RegCache
from .transport import VerbsTransport

__all__ = [
    "CTRL_SLOTS", "CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD", "FRAG", "FRAG_CREDIT", "FRAG_FIRST", "FRAG_NEXT",
    "HDR_FIRST", "NO_DEVICE", "SEND_WR_BASE", "SYSTEM_SITE_DIRS", "Device", "RegCache", "VerbsEndpoint",
    "VerbsTransport", "cuda_dmabuf_fd", "device_names", "device_range", "pyverbs", "register_device_buffer",
]
