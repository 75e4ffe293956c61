"""The user-facing API of the seed script: DistributedModel, DistributedOptimizer, step, data_loader."""
