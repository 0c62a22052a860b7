"""What a recipe is and what it asks of the mesh: the run config, verl's keys, which keys a run applies and which a
service fixes at start, the checks before anything starts, the GPU memory estimate, and the prompt datasets."""
