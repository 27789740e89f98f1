"""Tensor parallelism's group: one rank's place in it (`TensorParallel`), how a size is split over ranks, the
collectives the model uses, joining the process group (torch.distributed: gloo on CPU, NCCL on CUDA). The
processes themselves (starting workers, sending steps) are `kvflow.executor`'s."""
