"""Triedec on Ray Serve: engine replicas behind one gateway."""
