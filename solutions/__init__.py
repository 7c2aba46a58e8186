"""Reference solutions; where tpedu implements the exercise, the solution re-exports it."""
