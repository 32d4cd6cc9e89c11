"""The executor: the one place that runs jax for an engine. `build_executor` (executor.py) builds its two parts
over one mesh (one device being the 1 x 1 mesh): the ModelRunner (model_runner.py) turns each StepPlan into padded
device inputs and a call, and the Worker (worker.py) runs the call's jitted program on the devices and hands
process 0's calls to the other processes of a multi-process run."""
