"""What a job of ranks is and how it stays safe: the node layout, rank -> GPU, CUDA-awareness and NCCL
detection, node-shared memory, the watchdog and abort handler, and the cross-rank argument check."""
