"""Performance tools: the analytical model (estimate, calibration, render), operator model, micro-benchmarks,
study B's throughput and cost model, and the max-batch search."""
