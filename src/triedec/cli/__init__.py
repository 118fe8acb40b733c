"""The ``triedec`` command line: its flags (declared once, shared with Ray Serve's application arguments) and its
commands."""
