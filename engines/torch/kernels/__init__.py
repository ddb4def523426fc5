"""The torch fast path's Triton and CUDA ops, each with its torch form (the fallback where Triton
is missing, and what the tests compare against): the combine's gather-and-sum (gather), the
expert matmuls' weight gradient (grouped_dw), the SwiGLU backward (swiglu) and its fusion into
the grouped matmuls (swiglu_gemm), the router's top-k (topk) and TF32 logits (tf32), the head's
losses (xent), MasterAdamW's update (adamw_kernel), and the custom-op registration (ops).
engines/options.TorchKernels chooses among them when the model's loss is built."""
