//! Heartbeats between the ranks of the `tcp` backend (to be written).
