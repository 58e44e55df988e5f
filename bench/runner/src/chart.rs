//! PNG charts: TTFT distribution (CDF) per policy and prefix hit rate (pods vs oracle); per-pod
//! requests in flight over time (`<scenario>-load.png`); TTFT against offered load (sweeps).
//!
//! Text uses a TTF font read at run time (DejaVu Sans from Debian's fonts-dejavu-core, or
//! $BENCH_FONT); without one the chart is drawn without text and the legend is printed.

use crate::{label, Report};
use anyhow::{anyhow, Result};
use plotters::prelude::*;
use std::path::Path;

const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

static FONT_OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Registers a font for plotters once; false when none could be loaded.
fn load_font() -> bool {
    *FONT_OK.get_or_init(|| {
        let env = std::env::var("BENCH_FONT").ok();
        for p in env.iter().map(String::as_str).chain(FONT_CANDIDATES.iter().copied()) {
            if let Ok(bytes) = std::fs::read(p) {
                // plotters keeps the font for the life of the process.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

const COLORS: [RGBColor; 12] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(0, 0, 0),
    RGBColor(255, 187, 120),
];

/// Renders `w`×`h` pixels with `paint` and writes them to `out` as PNG.
fn write_png(
    out: &Path,
    (w, h): (u32, u32),
    paint: impl FnOnce(&Area<'_>, bool) -> Result<(), Box<dyn std::error::Error>>,
) -> Result<bool> {
    let mut buf = vec![255u8; (w * h * 3) as usize];
    let text = load_font();
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("{e:?}"))?;
        paint(&root, text).map_err(|e| anyhow!("{e}"))?;
        root.present().map_err(|e| anyhow!("{e:?}"))?;
    }
    let file = std::fs::File::create(out)?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut wr = enc.write_header()?;
    wr.write_image_data(&buf)?;
    wr.finish()?;
    Ok(text)
}

/// Draws the chart for `rep` into `out` (PNG), and the per-pod load chart beside it
/// (`<stem>-load.png`).
pub fn draw(rep: &Report, out: &Path) -> Result<()> {
    let text = write_png(out, (1400, 560), |root, text| {
        let (left, right) = root.split_horizontally(820);
        draw_cdf(rep, &left, text)?;
        draw_hits(rep, &right, text)?;
        Ok(())
    })?;
    if !text {
        eprintln!("chart drawn without text (no TTF font found; set BENCH_FONT); colours in policy order:");
        for (i, r) in rep.policies.iter().enumerate() {
            eprintln!("  colour {i}: {}", label(r, rep.config.gateway_replicas.len() > 1));
        }
    }
    let stem = out.file_stem().and_then(|s| s.to_str()).unwrap_or("chart");
    draw_load(rep, &out.with_file_name(format!("{stem}-load.png")))
}

/// Per-pod requests in flight over time, one panel per (replicas, policy), its first repetition.
pub fn draw_load(rep: &Report, out: &Path) -> Result<()> {
    let multi = rep.config.gateway_replicas.len() > 1;
    let panels: Vec<(String, &crate::stats::LoadSeries)> = rep
        .policies
        .iter()
        .filter_map(|a| {
            rep.runs
                .iter()
                .find(|r| r.policy == a.policy && r.gateway_replicas == a.gateway_replicas)
                .map(|r| (label(a, multi), &r.load_series))
        })
        .collect();
    let cols = 3usize;
    let rows = panels.len().div_ceil(cols).max(1);
    let ymax =
        panels.iter().flat_map(|(_, s)| s.inflight.iter().flatten().copied()).fold(1.0, f64::max)
            * 1.1;
    write_png(out, (1500, 330 * rows as u32), |root, text| {
        let areas = root.split_evenly((rows, cols));
        for ((name, series), area) in panels.iter().zip(areas.iter()) {
            let xmax =
                (series.step_s * series.inflight.first().map_or(1, Vec::len) as f64).max(1e-3);
            let mut b = ChartBuilder::on(area);
            b.margin(10);
            if text {
                b.caption(format!("{name}: requests in flight per pod"), ("sans-serif", 16))
                    .x_label_area_size(30)
                    .y_label_area_size(40);
            }
            let mut chart = b.build_cartesian_2d(0.0..xmax, 0.0..ymax)?;
            let mut mesh = chart.configure_mesh();
            if text {
                mesh.x_desc("wall s").label_style(("sans-serif", 12));
            } else {
                mesh.x_labels(0).y_labels(0);
            }
            mesh.draw()?;
            for (i, pod) in series.inflight.iter().enumerate() {
                let pts = pod.iter().enumerate().map(|(k, v)| (k as f64 * series.step_s, *v));
                let c = COLORS[i % COLORS.len()];
                let s = chart.draw_series(LineSeries::new(pts, c.stroke_width(2)))?;
                if text {
                    let pname = series.pods.get(i).cloned().unwrap_or_default();
                    s.label(pname).legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 15, y)], c.stroke_width(2))
                    });
                }
            }
            if text {
                chart
                    .configure_series_labels()
                    .position(SeriesLabelPosition::UpperRight)
                    .background_style(WHITE.mix(0.85))
                    .label_font(("sans-serif", 12))
                    .draw()?;
            }
        }
        Ok(())
    })?;
    Ok(())
}

/// TTFT (median over repetitions of the mean, and of the p50) against offered load, per policy.
pub fn draw_sweep(rep: &crate::sweep::SweepReport, out: &Path) -> Result<()> {
    let mut policies: Vec<&str> = Vec::new();
    for p in &rep.points {
        if !policies.contains(&p.aggregate.policy.as_str()) {
            policies.push(&p.aggregate.policy);
        }
    }
    let xmax = rep.rates.iter().copied().fold(0.0, f64::max) * 1.05;
    let ymax = rep.points.iter().map(|p| p.aggregate.ttft_mean_ms.max).fold(1.0, f64::max) * 1.1;
    write_png(out, (1100, 600), |root, text| {
        let mut b = ChartBuilder::on(root);
        b.margin(15);
        if text {
            b.caption(
                format!("{}: TTFT against offered load (open loop)", rep.scenario),
                ("sans-serif", 22),
            )
            .x_label_area_size(40)
            .y_label_area_size(60);
        }
        let mut chart = b.build_cartesian_2d(0.0..xmax, 0.0..ymax)?;
        let mut mesh = chart.configure_mesh();
        if text {
            mesh.x_desc("sessions started per simulated second")
                .y_desc("TTFT mean (simulated ms)")
                .label_style(("sans-serif", 14));
        } else {
            mesh.x_labels(0).y_labels(0);
        }
        mesh.draw()?;
        for (i, pol) in policies.iter().enumerate() {
            let c = COLORS[i % COLORS.len()];
            let pts: Vec<(f64, f64)> = rep
                .points
                .iter()
                .filter(|p| p.aggregate.policy == *pol)
                .map(|p| (p.sessions_per_s, p.aggregate.ttft_mean_ms.median))
                .collect();
            chart.draw_series(pts.iter().map(|&(x, y)| Circle::new((x, y), 4, c.filled())))?;
            let s = chart.draw_series(LineSeries::new(pts, c.stroke_width(3)))?;
            if text {
                s.label(pol.to_string()).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3))
                });
            }
        }
        if text {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 15))
                .draw()?;
        }
        Ok(())
    })?;
    Ok(())
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

fn draw_cdf(rep: &Report, area: &Area<'_>, text: bool) -> Result<(), Box<dyn std::error::Error>> {
    let multi = rep.config.gateway_replicas.len() > 1;
    // x range: up to the largest 99th value so the tails stay readable (clipped tails are drawn
    // at the edge).
    let xmax = rep
        .policies
        .iter()
        .map(|r| {
            let mut v = r.ttfts.clone();
            v.sort_by(|a, b| a.total_cmp(b));
            loadgen::stats::percentile(&v, 99.0)
        })
        .fold(1.0, f64::max)
        * 1.05;
    let mut b = ChartBuilder::on(area);
    b.margin(15);
    if text {
        b.caption(
            format!("{}: TTFT distribution (simulated ms)", rep.scenario),
            ("sans-serif", 22),
        )
        .x_label_area_size(40)
        .y_label_area_size(55);
    }
    let mut chart = b.build_cartesian_2d(0.0..xmax, 0.0..1.0)?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("TTFT (ms)").y_desc("share of requests").label_style(("sans-serif", 14));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw()?;
    for (i, r) in rep.policies.iter().enumerate() {
        let mut v = r.ttfts.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len().max(1) as f64;
        let pts: Vec<(f64, f64)> =
            v.iter().enumerate().map(|(k, x)| (x.min(xmax), (k + 1) as f64 / n)).collect();
        let c = COLORS[i % COLORS.len()];
        let s = chart.draw_series(LineSeries::new(pts, c.stroke_width(3)))?;
        if text {
            let name = format!("{} (mean {:.0} ms)", label(r, multi), r.ttft_mean_ms.median);
            s.label(name).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3))
            });
        }
    }
    if text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()?;
    }
    Ok(())
}

fn draw_hits(rep: &Report, area: &Area<'_>, text: bool) -> Result<(), Box<dyn std::error::Error>> {
    let multi = rep.config.gateway_replicas.len() > 1;
    let n = rep.policies.len().max(1);
    let mut b = ChartBuilder::on(area);
    b.margin(15);
    if text {
        b.caption("prefix cache hit rate (pods / oracle)", ("sans-serif", 22))
            .x_label_area_size(40)
            .y_label_area_size(45);
    }
    let mut chart = b.build_cartesian_2d(0.0..n as f64, 0.0..100.0)?;
    let mut mesh = chart.configure_mesh();
    mesh.disable_x_mesh().x_labels(0);
    if text {
        mesh.y_desc("% of prompt tokens").label_style(("sans-serif", 14));
    } else {
        mesh.y_labels(0);
    }
    mesh.draw()?;
    for (i, r) in rep.policies.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let x = i as f64;
        let hit = r.prefix_hit_rate.median * 100.0;
        let oracle = r.oracle_hit_rate.median * 100.0;
        chart.draw_series(std::iter::once(Rectangle::new(
            [(x + 0.12, 0.0), (x + 0.52, hit)],
            c.filled(),
        )))?;
        chart.draw_series(std::iter::once(Rectangle::new(
            [(x + 0.52, 0.0), (x + 0.88, oracle)],
            c.mix(0.35).filled(),
        )))?;
        if text {
            chart.draw_series(std::iter::once(Text::new(
                format!("{hit:.0}%"),
                (x + 0.14, (hit + 6.0).min(99.0)),
                ("sans-serif", 15),
            )))?;
            let short: String = label(r, multi)
                .replace("global_least_request", "least_req")
                .replace("endpoint_metrics", "metrics");
            chart.draw_series(std::iter::once(Text::new(
                short,
                (x + 0.05, 3.0),
                ("sans-serif", 13).into_font().color(&BLACK),
            )))?;
        }
    }
    Ok(())
}
