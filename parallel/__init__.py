"""Data parallelism: communicators (comm), launching ranks (launch), and the replicated
model with bucketed gradient all-reduce (ddp). Nothing here imports a model."""
