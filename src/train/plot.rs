//! Loss curves as a hand-written SVG: one or more panels stacked on a shared
//! step axis, each with its series, a legend, units and marked steps.

use std::fmt::Write;

/// A named polyline (or a set of dots).
pub struct Series<'a> {
    /// The legend's label.
    pub name: &'a str,
    /// An SVG color, e.g. `#1f77b4` (written into the document as given).
    pub color: &'a str,
    /// `(step, value)` points; non-finite values are left out of the plot.
    pub points: Vec<(f64, f64)>,
    /// Draw dots instead of a line (sparse series such as validation loss);
    /// the legend shows a dot too.
    pub dots: bool,
}

/// One plot area: its series against the step, on a linear or log y axis.
pub struct Panel<'a> {
    /// The y axis label, with its unit, e.g. `loss (nats/byte, log scale)`.
    pub y_label: &'a str,
    /// A logarithmic y axis (every value must then be positive; others are
    /// left out).
    pub log_y: bool,
    /// Height of the plot area in pixels.
    pub height: f64,
    /// The series drawn in this panel, listed in its legend in this order.
    pub series: Vec<Series<'a>>,
    /// Steps marked with a dashed vertical line and a label (e.g. where a
    /// run was resumed).
    pub marks: Vec<(f64, String)>,
    /// Draw the line y = 0 (a difference panel).
    pub zero_line: bool,
}

const WIDTH: f64 = 760.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const GAP: f64 = 30.0;
const BOTTOM: f64 = 45.0;

/// An SVG document with `panels` stacked top to bottom over one step axis.
pub fn chart_svg(title: &str, panels: &[Panel]) -> String {
    let height = TOP + panels.iter().map(|p| p.height + GAP).sum::<f64>() - GAP + BOTTOM;
    let (x0, x1) = x_range(panels);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(
        s,
        r#"<rect width="{WIDTH}" height="{height}" fill="white"/>"#
    );
    let _ = write!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    let mut top = TOP;
    for p in panels {
        draw_panel(&mut s, p, top, (x0, x1));
        top += p.height + GAP;
    }
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">optimizer step</text>"#,
        (LEFT + WIDTH - RIGHT) / 2.0,
        height - 8.0
    );
    s.push_str("</svg>\n");
    s
}

fn x_range(panels: &[Panel]) -> (f64, f64) {
    let xs = panels
        .iter()
        .flat_map(|p| p.series.iter().flat_map(|s| s.points.iter().map(|q| q.0)));
    let (lo, hi) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    if lo > hi {
        (0.0, 1.0)
    } else if hi - lo < 1e-9 {
        (lo, lo + 1.0)
    } else {
        (lo, hi)
    }
}

fn draw_panel(s: &mut String, p: &Panel, top: f64, (x0, x1): (f64, f64)) {
    let (l, r, h) = (LEFT, WIDTH - RIGHT, p.height);
    let shown = |v: f64| v.is_finite() && (!p.log_y || v > 0.0);
    let ys = p
        .series
        .iter()
        .flat_map(|se| se.points.iter().map(|q| q.1))
        .filter(|&v| shown(v));
    let (mut y0, mut y1) = ys.fold((f64::MAX, f64::MIN), |(a, b), y| (a.min(y), b.max(y)));
    if p.zero_line {
        (y0, y1) = (y0.min(0.0), y1.max(0.0));
    }
    if y0 > y1 {
        (y0, y1) = (1.0, 2.0);
    }
    // the axis works in log space on a log panel
    let f = |v: f64| if p.log_y { v.ln() } else { v };
    let (f0, f1) = (f(y0), f(y1));
    let pad = ((f1 - f0) * 0.05).max(1e-3);
    let (f0, f1) = (f0 - pad, f1 + pad);
    let sx = |x: f64| l + (x - x0) / (x1 - x0) * (r - l);
    let sy = |y: f64| top + (f1 - f(y)) / (f1 - f0) * h;
    let (lo, hi) = if p.log_y {
        (f0.exp(), f1.exp())
    } else {
        (f0, f1)
    };
    let n = if h < 200.0 { 4 } else { 6 };
    let ticks = if p.log_y {
        log_ticks(lo, hi, n)
    } else {
        nice_ticks(lo, hi, n)
    };
    for ty in ticks {
        if p.log_y && ty <= 0.0 {
            continue;
        }
        let y = sy(ty);
        let _ = write!(
            s,
            r##"<line x1="{l}" y1="{y:.1}" x2="{r}" y2="{y:.1}" stroke="#e4e4e4"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            l - 6.0,
            y + 4.0,
            fmt_tick(ty)
        );
    }
    for tx in nice_ticks(x0, x1, 8) {
        let x = sx(tx);
        let _ = write!(
            s,
            r##"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{}" stroke="#f0f0f0"/><text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"##,
            top + h,
            top + h + 14.0,
            fmt_tick(tx)
        );
    }
    if p.zero_line {
        let y = sy(0.0);
        let _ = write!(
            s,
            r##"<line x1="{l}" y1="{y:.1}" x2="{r}" y2="{y:.1}" stroke="#888"/>"##
        );
    }
    for (x, label) in &p.marks {
        let x = sx(*x);
        let _ = write!(
            s,
            r##"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{}" stroke="#777" stroke-dasharray="4 3"/><text x="{:.1}" y="{}" fill="#555">{}</text>"##,
            top + h,
            x + 3.0,
            top + h - 4.0,
            escape(label)
        );
    }
    let _ = write!(
        s,
        r##"<rect x="{l}" y="{top}" width="{}" height="{h}" fill="none" stroke="#444"/>"##,
        r - l
    );
    let mid = top + h / 2.0;
    let _ = write!(
        s,
        r#"<text x="16" y="{mid}" text-anchor="middle" transform="rotate(-90 16 {mid})">{}</text>"#,
        escape(p.y_label)
    );
    // the legend sits top right, as wide as its longest label (~6.6 px a
    // character at 12 px)
    let longest = p
        .series
        .iter()
        .map(|se| se.name.chars().count())
        .max()
        .unwrap_or(0);
    let lx = (r - 34.0 - 6.6 * longest as f64).max(l + 8.0);
    for (i, se) in p.series.iter().enumerate() {
        let pts: Vec<_> = se.points.iter().filter(|q| shown(q.1)).collect();
        if se.dots {
            for q in &pts {
                let _ = write!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{}"/>"#,
                    sx(q.0),
                    sy(q.1),
                    se.color
                );
            }
        } else if !pts.is_empty() {
            let d: Vec<String> = pts
                .iter()
                .map(|q| format!("{:.1},{:.1}", sx(q.0), sy(q.1)))
                .collect();
            let _ = write!(
                s,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
                se.color,
                d.join(" ")
            );
        }
        let ly = top + 14.0 + 16.0 * i as f64;
        let key = if se.dots {
            format!(
                r#"<circle cx="{}" cy="{ly}" r="3" fill="{}"/>"#,
                lx + 10.0,
                se.color
            )
        } else {
            format!(
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="3"/>"#,
                lx + 20.0,
                se.color
            )
        };
        let _ = write!(
            s,
            r#"{key}<text x="{}" y="{}">{}</text>"#,
            lx + 26.0,
            ly + 4.0,
            escape(se.name)
        );
    }
}

fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let span = (hi - lo).max(1e-12);
    let raw = span / n as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| span / s <= n as f64)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut out = vec![];
    while t <= hi + 1e-9 * step {
        // -0.0 and rounding dust read as 0
        out.push(if t.abs() < 1e-9 * step { 0.0 } else { t });
        t += step;
    }
    out
}

/// Ticks of a log axis: 1, 2 and 5 times each power of ten in `[lo, hi]`;
/// the powers of ten alone when those are too many (more than `2n`); the
/// linear ticks when fewer than three fall inside (a range within a decade).
fn log_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let per_decade = |m: &[f64]| -> Vec<f64> {
        let (k0, k1) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
        (k0..=k1)
            .flat_map(|k| m.iter().map(move |x| x * 10f64.powi(k)))
            .filter(|&t| t >= lo * (1.0 - 1e-9) && t <= hi * (1.0 + 1e-9))
            .collect()
    };
    let fine = per_decade(&[1.0, 2.0, 5.0]);
    if fine.len() >= 3 && fine.len() <= 2 * n {
        return fine;
    }
    let coarse = per_decade(&[1.0]);
    if fine.len() > 2 * n && coarse.len() >= 2 {
        return coarse;
    }
    nice_ticks(lo, hi, n)
}

fn fmt_tick(v: f64) -> String {
    if v.abs() >= 100.0 || v == v.round() {
        format!("{v:.0}")
    } else if v.abs() >= 0.01 {
        format!("{}", (v * 1000.0).round() / 1000.0)
    } else {
        format!("{v:.1e}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panel(log_y: bool, series: Vec<Series<'static>>) -> Panel<'static> {
        Panel {
            y_label: "loss (nats/byte)",
            log_y,
            height: 300.0,
            series,
            marks: vec![(5.0, "resumed".into())],
            zero_line: false,
        }
    }

    #[test]
    fn legends_match_the_marks_and_a_log_axis_spaces_by_ratio() {
        let line = Series {
            name: "train",
            color: "#111111",
            points: vec![(1.0, 1.0), (5.0, 10.0), (10.0, 100.0)],
            dots: false,
        };
        let dots = Series {
            name: "val",
            color: "#222222",
            points: vec![(10.0, 10.0)],
            dots: true,
        };
        let svg = chart_svg("t", &[panel(true, vec![line, dots])]);
        // the dotted series' legend key is a dot, the line's a line
        assert_eq!(svg.matches(r##"fill="#222222""##).count(), 2, "{svg}");
        assert_eq!(
            svg.matches(r##"stroke="#111111" stroke-width="3""##)
                .count(),
            1
        );
        assert!(svg.contains("nats/byte") && svg.contains("optimizer step"));
        assert!(svg.contains("stroke-dasharray") && svg.contains(">resumed<"));
        // 1, 10, 100 equally spaced on a log axis
        let poly = svg.split(r#"points=""#).nth(1).unwrap();
        let ys: Vec<f64> = poly
            .split('"')
            .next()
            .unwrap()
            .split(' ')
            .map(|p| p.split(',').nth(1).unwrap().parse().unwrap())
            .collect();
        assert!(((ys[0] - ys[1]) - (ys[1] - ys[2])).abs() < 0.2, "{ys:?}");
    }

    /// Labels on a log axis are 1-2-5 per decade, not a linear axis's steps.
    #[test]
    fn a_log_axis_is_labelled_one_two_five() {
        let curve = Series {
            name: "train",
            color: "#111111",
            points: vec![(1.0, 5.6), (150.0, 1.3), (300.0, 0.42)],
            dots: false,
        };
        let svg = chart_svg("t", &[panel(true, vec![curve])]);
        let labels: Vec<&str> = svg
            .split(r#"text-anchor="end">"#)
            .skip(1)
            .map(|t| t.split('<').next().unwrap())
            .collect();
        assert_eq!(labels, ["0.5", "1", "2", "5"], "{svg}");
        // over many decades: the powers of ten; within one: linear steps
        assert_eq!(log_ticks(1e-3, 1e3, 6).len(), 7);
        assert_eq!(log_ticks(1.8, 2.6, 6), nice_ticks(1.8, 2.6, 6));
    }

    #[test]
    fn a_difference_panel_shows_zero_and_the_sign() {
        let d = Series {
            name: "mixed - fp32",
            color: "#333333",
            points: vec![(1.0, 0.01), (2.0, -0.02)],
            dots: false,
        };
        let p = Panel {
            zero_line: true,
            height: 150.0,
            ..panel(false, vec![d])
        };
        let svg = chart_svg("t", &[p]);
        assert!(svg.contains(r##"stroke="#888""##), "{svg}");
        assert!(svg.contains(">-0.02<") && svg.contains(">0<"), "{svg}");
    }
}
