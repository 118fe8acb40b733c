"""The engine: one request's state, the batch step, runs with loops of their own (beam), the methods' front door."""
