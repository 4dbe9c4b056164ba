"""Ways into rrfp's library from the frameworks users train with (each module imports its framework
only when used): :mod:`rrfp.exec.integrations.torchtitan` is torchtitan's ``--module``."""
