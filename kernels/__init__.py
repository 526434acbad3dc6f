"""lorad compute kernels: frozen linears on NPU/CPU backends, LoRA ops, precision planning."""
