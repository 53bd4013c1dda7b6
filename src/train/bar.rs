//! The progress bar a run draws on a terminal: one line, redrawn in place,
//! `[#########.........] 120/300 loss 1.9 … 4m10s<5m48s`.

use std::io::Write;

/// One line on stderr, redrawn at each update; the caller checks that
/// stderr is a terminal.
pub(crate) struct Bar {
    len: u64,
    /// The position this process started from (the ETA counts its own steps).
    first: u64,
}

const WIDTH: u64 = 30;

impl Bar {
    pub(crate) fn new(len: u64, pos: u64) -> Bar {
        Bar { len, first: pos }
    }

    /// Redraws the line at `pos` with `msg`, `elapsed` seconds into this
    /// process's part of the run.
    pub(crate) fn update(&self, pos: u64, msg: &str, elapsed: f64) {
        let line = self.line(pos, msg, elapsed);
        let _ = write!(std::io::stderr(), "\r\x1b[2K{line}");
    }

    /// The line at `pos` after `elapsed` seconds of this process.
    fn line(&self, pos: u64, msg: &str, elapsed: f64) -> String {
        let filled = (pos.min(self.len) * WIDTH)
            .checked_div(self.len)
            .unwrap_or(WIDTH);
        let done = pos.saturating_sub(self.first);
        let eta = match done {
            0 => "?".to_string(),
            _ => duration(elapsed / done as f64 * self.len.saturating_sub(pos) as f64),
        };
        format!(
            "[{}{}] {pos}/{} {msg} {}<{eta}",
            "#".repeat(filled as usize),
            ".".repeat((WIDTH - filled) as usize),
            self.len,
            duration(elapsed)
        )
    }

    /// Leaves the last line standing (the run finished or stopped).
    pub(crate) fn finish(&self) {
        let _ = writeln!(std::io::stderr());
    }
}

/// Seconds as `42s`, `12m05s` or `3h07m`.
pub(crate) fn duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_line_shows_the_share_done_and_the_time_left() {
        let b = super::Bar::new(300, 100);
        assert_eq!(
            b.line(120, "loss 1.9", 40.0),
            format!(
                "[{}{}] 120/300 loss 1.9 40s<6m00s",
                "#".repeat(12),
                ".".repeat(18)
            )
        );
        assert!(b.line(100, "", 0.0).ends_with("0s<?"));
        assert_eq!(b.line(300, "", 1.0).matches('#').count(), 30);
    }

    #[test]
    fn durations_read_as_a_person_would_say_them() {
        let d = super::duration;
        assert_eq!(
            [d(0.4), d(59.4), d(60.0), d(725.0), d(3599.0), d(11_220.0)],
            ["0s", "59s", "1m00s", "12m05s", "59m59s", "3h07m"]
        );
    }
}
