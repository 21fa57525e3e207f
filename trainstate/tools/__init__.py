"""Tools over stored generations that are neither saving nor restoring: ``diff`` (two generations compared in
causal order) and ``export`` (one component's weights released as safetensors)."""
