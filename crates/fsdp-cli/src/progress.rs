//! What `fsdp train` prints while it trains: a progress bar on a terminal, plain log lines
//! otherwise (the [`Observer`] of rank 0).

use fsdp::train::{Observer, StepRecord};
use indicatif::ProgressBar;

/// Progress bar on a terminal, plain log lines otherwise.
pub(crate) struct Progress {
    pub(crate) bar: Option<ProgressBar>,
    pub(crate) log_every: usize,
    pub(crate) steps: usize,
}

impl Progress {
    fn say(&self, line: String) {
        match &self.bar {
            Some(b) => b.println(line),
            None => out!("{line}"),
        }
    }
}

impl Observer for Progress {
    fn on_start(&self, num_params: usize) {
        self.say(format!("model: {num_params} parameters"));
    }
    fn on_resume(&self, step: usize, dir: &std::path::Path) {
        self.say(format!(
            "resumed from {} (after step {step})",
            dir.display()
        ));
    }
    fn on_checkpoint(&self, step: usize, dir: &std::path::Path) {
        self.say(format!(
            "step {step:>5} | saved checkpoint {}",
            dir.display()
        ));
    }
    fn on_save_stall(&self, step: usize, stall_s: f64) {
        self.say(format!(
            "step {step:>5} | save_stall_ms {:.1}",
            stall_s * 1e3
        ));
    }
    fn on_step(&self, r: &StepRecord) {
        // Under the grad scaler: the step's loss scale, and whether it skipped the update.
        let scale = r.loss_scale.map_or(String::new(), |s| {
            let skipped = if r.skipped {
                " (skipped: inf/NaN gradients)"
            } else {
                ""
            };
            format!(" | loss scale {}{skipped}", scale_text(s))
        });
        if let Some(b) = &self.bar {
            b.set_position(r.step as u64);
            b.set_message(format!(
                "loss {:.4} | {:.0} tok/s{scale}",
                r.loss, r.tokens_per_s
            ));
        }
        if self.log_every > 0
            && (r.step % self.log_every == 0 || r.step == 1 || r.step == self.steps || r.skipped)
        {
            self.say(format!(
                "step {:>5} | loss {:.4} | {:.0} tok/s{scale}",
                r.step, r.loss, r.tokens_per_s
            ));
        }
        if let Some(e) = r.eval_loss {
            self.say(format!("step {:>5} | eval loss {e:.4}", r.step));
        }
    }
}

/// A loss scale as a user reads it: whole numbers in full (`65536`, `1099511627776`), a
/// scale below 1 as its shortest decimal.
pub(crate) fn scale_text(s: f32) -> String {
    if s >= 1.0 && s.is_finite() {
        format!("{s:.0}")
    } else {
        s.to_string()
    }
}
