"""Tensor parallelism across processes and machines (torch.distributed: gloo on CPU, NCCL on CUDA).

- `parallel_state`: one rank's place in the group (`TensorParallel`), how a size is split over ranks, the
  collectives the model uses, joining the process group;
- `executor`: rank 0's side (the server process): starts the local workers, sends each step, notices deaths;
- `worker`: the other ranks' side: receive a step, run the model's share of it, repeat.
"""
