"""The Sandblaster coordinator (DistBelief 4.2): batch optimization through vector operations on the parameter servers."""
