"""Weight transport from the trainer to the rollout engines: shared memory on one host (``shm``), CUDA
IPC handles on a GPU (``cuda``) and the chunked transfer across hosts (``transfer``)."""
