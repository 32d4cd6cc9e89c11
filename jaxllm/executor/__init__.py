"""The executor: the one place that runs jax for an engine. It turns a StepPlan into padded device inputs,
runs the jitted step over the mesh (one device being the 1 x 1 mesh), and hands process 0's calls to the
other processes of a multi-process run."""
