"""What the study (fusedmlp.profile) and the bench (fusedmlp.bench) share; not the library."""
