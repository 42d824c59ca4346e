"""One model across several processes (hosts) started by `mlx.launch`: rank 0 serves HTTP and
decides; every rank holds its shard of the model and of the prompt cache and follows."""
