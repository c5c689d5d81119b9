//! fsdp-candle's tests: candle-nn models trained through fsdp against the plain candle loop
//! (`parity`), checkpoints across world sizes (`checkpoint`), calls that would train wrong
//! (`guards`), a bad loss on one rank (`recover`) and a multi-process run of the example
//! under `elastic_launch` (`launch`).
//! One test binary, so the crate links candle and fsdp once.

mod checkpoint;
mod guards;
mod launch;
mod models;
mod parity;
mod recover;
