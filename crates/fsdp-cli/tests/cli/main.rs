//! The `fsdp` command as a user runs it, in one test binary (see docs/layout.md, "Tests"):
//! `fsdp train` (`cli`), checkpoints through the binary (`checkpoint`), `fsdp launch`
//! (`launch`, with its orphans and restarts), two nodes on network namespaces (`netns`),
//! `fsdp plot` (`plot`), timeouts and heartbeats (`waits`). Each file is a module, its tests
//! named `<file>::<test>`.

#[path = "../../../../tests/common/mod.rs"]
mod common;
#[path = "support/job.rs"]
mod support;

mod checkpoint;
mod cli;
mod launch;
mod netns;
mod plot;
mod waits;
