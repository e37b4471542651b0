"""compare: a candidate precision against fp64, module by module, and the op-level judges of its passes."""
