//! Loss curves as a hand-written SVG: one or more series of `(step, loss)`
//! points on shared axes, with a legend.

use std::fmt::Write;

/// A named polyline.
pub struct Series<'a> {
    pub name: &'a str,
    pub color: &'a str,
    pub points: Vec<(f64, f64)>,
    /// Draw dots instead of a line (sparse series such as validation loss).
    pub dots: bool,
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
        out.push(t);
        t += step;
    }
    out
}

/// An SVG document plotting `series` (loss against step).
pub fn loss_svg(title: &str, series: &[Series]) -> String {
    let (w, h) = (720.0, 420.0);
    let (l, r, t, b) = (60.0, 20.0, 40.0, 45.0);
    let pts = series
        .iter()
        .flat_map(|s| s.points.iter())
        .filter(|p| p.1.is_finite());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 - x0 < 1e-9 {
        x1 = x0 + 1.0;
    }
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    let (y0, y1) = (y0 - pad, y1 + pad);
    let sx = |x: f64| l + (x - x0) / (x1 - x0) * (w - l - r);
    let sy = |y: f64| t + (y1 - y) / (y1 - y0) * (h - t - b);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = write!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        w / 2.0,
        escape(title)
    );
    for ty in nice_ticks(y0, y1, 6) {
        let y = sy(ty);
        let _ = write!(
            s,
            r##"<line x1="{l}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#e4e4e4"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            w - r,
            l - 6.0,
            y + 4.0,
            fmt_tick(ty)
        );
    }
    for tx in nice_ticks(x0, x1, 8) {
        let x = sx(tx);
        let _ = write!(
            s,
            r##"<line x1="{x:.1}" y1="{t}" x2="{x:.1}" y2="{}" stroke="#f0f0f0"/><text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"##,
            h - b,
            h - b + 16.0,
            fmt_tick(tx)
        );
    }
    let _ = write!(
        s,
        r##"<rect x="{l}" y="{t}" width="{}" height="{}" fill="none" stroke="#444"/>"##,
        w - l - r,
        h - t - b
    );
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">step</text>"#,
        (l + w - r) / 2.0,
        h - 8.0
    );
    let _ = write!(
        s,
        r#"<text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">loss</text>"#,
        (t + h - b) / 2.0,
        (t + h - b) / 2.0
    );
    for (i, se) in series.iter().enumerate() {
        let finite: Vec<_> = se.points.iter().filter(|p| p.1.is_finite()).collect();
        if se.dots {
            for p in &finite {
                let _ = write!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{}"/>"#,
                    sx(p.0),
                    sy(p.1),
                    se.color
                );
            }
        } else if !finite.is_empty() {
            let d: Vec<String> = finite
                .iter()
                .map(|p| format!("{:.1},{:.1}", sx(p.0), sy(p.1)))
                .collect();
            let _ = write!(
                s,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
                se.color,
                d.join(" ")
            );
        }
        let ly = t + 14.0 + 16.0 * i as f64;
        let lx = w - r - 170.0;
        let _ = write!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            lx + 20.0,
            se.color,
            lx + 26.0,
            ly + 4.0,
            escape(se.name)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn fmt_tick(v: f64) -> String {
    if v.abs() >= 100.0 || v == v.round() {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
