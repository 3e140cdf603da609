"""The in-process runtime of one watched run: hooks on the training thread, the sampler and the
writer. Takes the model and optimizer; hands readings to the policy and events to the store."""
