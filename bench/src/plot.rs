//! `plot`: PNG charts of a results directory (what `bench/compare.sh` writes).
//!
//! Files read (each optional; a chart whose inputs are all missing is skipped):
//! `ours_tcp.json`, `ours_shm.json` (`remote` rows), `mooncake.json` (the reference
//! anchor's rows), `memcpy.json`, `limits.json` (`iperf3_GB_per_s`, …),
//! `trace_ours.json`, `trace_ours_ssd.json`, `trace_ref.json` (trace replays).
//!
//! Charts written: `throughput.png` (GB/s vs object size per transport, get and put,
//! with the reference and the physical limits as lines), `trace_hit_ratio.png`
//! (replay vs simulation vs reference, DRAM and SSD parts) and
//! `trace_latency_cdf.png` (per-request prefix-fetch latency).
//!
//! Text is drawn with a font shipped in a crate (DejaVu Sans, through `ab_glyph`),
//! so no system font library or font file is needed.

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::Value;

type Res<T> = Result<T, String>;

fn e(err: impl std::fmt::Display) -> String {
    err.to_string()
}

fn load(dir: &Path, name: &str) -> Option<Value> {
    let text = std::fs::read_to_string(dir.join(name)).ok()?;
    serde_json::from_str(&text).ok()
}

fn register_font() -> Res<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "cannot load the embedded font".to_string())
}

/// `(size, GB/s)` of the rows of `v` with this api (and mode, when rows carry one).
fn series(v: &Value, api: &str, mode: Option<&str>) -> Vec<(f64, f64)> {
    let mut pts: Vec<(f64, f64)> = v["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["api"] == api && r["batch"].as_u64().unwrap_or(1) == 1)
        .filter(|r| mode.is_none_or(|m| r["mode"] == m))
        .filter_map(|r| Some((r["size"].as_f64()?, r["GB_per_s"].as_f64()?)))
        .filter(|&(s, g)| s > 0.0 && g > 0.0)
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    pts
}

/// The distinct object sizes of some points.
fn sizes(points: &[(f64, f64)]) -> Vec<f64> {
    let mut s: Vec<f64> = points.iter().map(|p| p.0).collect();
    s.sort_by(f64::total_cmp);
    s.dedup();
    s
}

/// A number with as few decimals as its size needs (0.01, 0.5, 2, 10).
fn trim(v: f64) -> String {
    let t = format!("{v:.3}");
    t.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn size_label(s: f64) -> String {
    let s = s.round() as u64;
    if s >= 1 << 20 && s.is_multiple_of(1 << 20) {
        format!("{}M", s >> 20)
    } else if s >= 1 << 10 && s.is_multiple_of(1 << 10) {
        format!("{}K", s >> 10)
    } else {
        s.to_string()
    }
}

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Writes every chart it has inputs for; returns the files written.
pub fn plot(dir: &Path, out_dir: &Path) -> Res<Vec<PathBuf>> {
    register_font()?;
    std::fs::create_dir_all(out_dir).map_err(e)?;
    let mut written = Vec::new();
    if let Some(p) = throughput(dir, out_dir)? {
        written.push(p);
    }
    if let Some(p) = hit_ratio(dir, out_dir)? {
        written.push(p);
    }
    if let Some(p) = latency_cdf(dir, out_dir)? {
        written.push(p);
    }
    Ok(written)
}

fn throughput(dir: &Path, out_dir: &Path) -> Res<Option<PathBuf>> {
    let (tcp, shm, reference) = (load(dir, "ours_tcp.json"), load(dir, "ours_shm.json"), load(dir, "mooncake.json"));
    if tcp.is_none() && shm.is_none() && reference.is_none() {
        return Ok(None);
    }
    let memcpy = load(dir, "memcpy.json").and_then(|v| v["GB_per_s"].as_f64());
    let iperf = load(dir, "limits.json").and_then(|v| v["iperf3_GB_per_s"].as_f64());
    let path = out_dir.join("throughput.png");
    let root = BitMapBackend::new(&path, (1400, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let panels = root.split_evenly((1, 2));
    // get: our get_into vs the reference's get_into (its zero-copy read); put: our
    // put (from any caller memory) vs the reference's put_from (its zero-copy write).
    for (panel, (title, ours_api, ref_api)) in panels
        .iter()
        .zip([("get (remote, one client)", "get_into", "get_into"), ("put (remote, one client)", "put", "put_from")])
    {
        let mut lines: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        if let Some(v) = &tcp {
            lines.push((format!("mooncake-rs tcp {ours_api}"), series(v, ours_api, None)));
        }
        if let Some(v) = &shm {
            lines.push((format!("mooncake-rs shm {ours_api}"), series(v, ours_api, None)));
        }
        if let Some(v) = &reference {
            lines.push((format!("Mooncake (reference) tcp {ref_api}"), series(v, ref_api, Some("remote"))));
        }
        lines.retain(|(_, pts)| !pts.is_empty());
        let all: Vec<(f64, f64)> = lines.iter().flat_map(|(_, p)| p.iter().copied()).collect();
        let (xmin, xmax) = all.iter().fold((f64::MAX, 0f64), |(a, b), p| (a.min(p.0), b.max(p.0)));
        let (xmin, xmax) = if all.is_empty() { (4096.0, 4194304.0) } else { (xmin, xmax.max(xmin * 2.0)) };
        let ymax = all.iter().map(|p| p.1).chain(memcpy).chain(iperf).fold(0.01f64, f64::max) * 2.0;
        let ymin = all.iter().map(|p| p.1).fold(ymax, f64::min).max(1e-4) / 2.0;
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(
                // Ticks at the measured sizes (powers of two), not at powers of ten.
                (xmin..xmax).log_scale().with_key_points(sizes(&all)),
                (ymin..ymax).log_scale(),
            )
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc("object size")
            .y_desc("GB/s (log scale)")
            .x_label_formatter(&|x| size_label(*x))
            .y_label_formatter(&|y| trim(*y))
            .draw()
            .map_err(e)?;
        for (i, (name, pts)) in lines.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
                .map_err(e)?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled()))).map_err(e)?;
        }
        for (i, (name, value)) in [("iperf3 loopback (TCP limit)", iperf), ("memcpy (Shm limit)", memcpy)]
            .into_iter()
            .enumerate()
            .filter_map(|(i, (n, v))| v.map(|v| (i, (n, v))))
        {
            let color = PALETTE[(4 + i) % PALETTE.len()];
            chart
                .draw_series(DashedLineSeries::new([(xmin, value), (xmax, value)], 8, 6, color.stroke_width(2)))
                .map_err(e)?
                .label(format!("{name}: {value:.2} GB/s"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(Some(path.clone()))
}

/// One bar of the hit-ratio chart: DRAM part and SSD part.
struct Bar {
    label: String,
    dram: f64,
    ssd: f64,
}

fn hit_ratio(dir: &Path, out_dir: &Path) -> Res<Option<PathBuf>> {
    let mut bars = Vec::new();
    let ours_label = |v: &Value, ssd: bool| {
        let p = &v["params"];
        format!(
            "mooncake-rs{}\n{} MiB DRAM{}",
            if ssd { " +SSD" } else { "" },
            p["dram_bytes"].as_u64().unwrap_or(0) >> 20,
            if ssd { format!(" + {} MiB SSD", p["ssd_bytes"].as_u64().unwrap_or(0) >> 20) } else { String::new() }
        )
    };
    for (file, ssd) in [("trace_ours.json", false), ("trace_ours_ssd.json", true)] {
        if let Some(v) = load(dir, file) {
            bars.push(Bar {
                label: ours_label(&v, ssd),
                dram: v["dram_hit_ratio"].as_f64().unwrap_or(0.0),
                ssd: v["ssd_hit_ratio"].as_f64().unwrap_or(0.0),
            });
            bars.push(Bar {
                label: format!("LRU simulation\n(same capacities{})", if ssd { ", +SSD" } else { "" }),
                dram: v["sim"]["dram_hit_ratio"].as_f64().unwrap_or(0.0),
                ssd: v["sim"]["ssd_hit_ratio"].as_f64().unwrap_or(0.0),
            });
        }
    }
    if let Some(v) = load(dir, "trace_ref.json") {
        bars.push(Bar {
            label: format!("Mooncake (reference)\n{} MiB DRAM", v["params"]["dram_bytes"].as_u64().unwrap_or(0) >> 20),
            dram: v["hit_ratio"].as_f64().unwrap_or(0.0),
            ssd: 0.0,
        });
    }
    if bars.is_empty() {
        return Ok(None);
    }
    let path = out_dir.join("trace_hit_ratio.png");
    let root = BitMapBackend::new(&path, (1000, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let top = bars.iter().map(|b| b.dram + b.ssd).fold(0.1f64, f64::max);
    let n = bars.len();
    let mut chart = ChartBuilder::on(&root)
        .caption("Trace replay: prefix hit ratio (blocks fetched / blocks looked up)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(50)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..n as f64, 0f64..(top * 1.25).min(1.0))
        .map_err(e)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("hit ratio")
        .y_label_formatter(&|y| format!("{y:.2}"))
        .draw()
        .map_err(e)?;
    let (dram_c, ssd_c) = (PALETTE[0], PALETTE[1]);
    chart
        .draw_series(
            bars.iter()
                .enumerate()
                .map(|(i, b)| Rectangle::new([(i as f64 + 0.15, 0.0), (i as f64 + 0.85, b.dram)], dram_c.filled())),
        )
        .map_err(e)?
        .label("DRAM hits")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], dram_c.filled()));
    chart
        .draw_series(bars.iter().enumerate().map(|(i, b)| {
            Rectangle::new([(i as f64 + 0.15, b.dram), (i as f64 + 0.85, b.dram + b.ssd)], ssd_c.filled())
        }))
        .map_err(e)?
        .label("SSD hits")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], ssd_c.filled()));
    let centered = TextStyle::from(("sans-serif", 13).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
    let value_style = TextStyle::from(("sans-serif", 15).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
    for (i, b) in bars.iter().enumerate() {
        let x = i as f64 + 0.5;
        chart
            .draw_series([Text::new(format!("{:.3}", b.dram + b.ssd), (x, b.dram + b.ssd), value_style.clone())])
            .map_err(e)?;
        // Bar names under the axis, in pixels of the whole image (the chart's own
        // coordinates stop at the axis).
        let (px, py) = chart.backend_coord(&(x, 0.0));
        for (j, line) in b.label.lines().enumerate() {
            root.draw(&Text::new(line.to_string(), (px, py + 8 + 16 * j as i32), centered.clone())).map_err(e)?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(Some(path.clone()))
}

fn latency_cdf(dir: &Path, out_dir: &Path) -> Res<Option<PathBuf>> {
    let mut lines: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for (file, name) in [
        ("trace_ours.json", "mooncake-rs (DRAM)"),
        ("trace_ours_ssd.json", "mooncake-rs (DRAM + SSD)"),
        ("trace_ref.json", "Mooncake reference (DRAM)"),
    ] {
        let Some(v) = load(dir, file) else { continue };
        let pts: Vec<(f64, f64)> = v["cdf"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| Some((p[0].as_f64()?.max(0.1), p[1].as_f64()?)))
            .collect();
        if !pts.is_empty() {
            let transport = v["params"]["transport"].as_str().unwrap_or("tcp");
            lines.push((format!("{name}, {transport}"), pts));
        }
    }
    if lines.is_empty() {
        return Ok(None);
    }
    let path = out_dir.join("trace_latency_cdf.png");
    let root = BitMapBackend::new(&path, (1000, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let xmax = lines.iter().flat_map(|(_, p)| p.iter().map(|q| q.0)).fold(10f64, f64::max) * 1.5;
    let xmin = lines.iter().flat_map(|(_, p)| p.iter().map(|q| q.0)).fold(xmax, f64::min).max(1.0) / 1.5;
    let mut chart = ChartBuilder::on(&root)
        .caption("Trace replay: per-request prefix-fetch latency (CDF)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((xmin..xmax).log_scale(), 0f64..1f64)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("latency (µs, log scale)")
        .y_desc("fraction of requests")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(e)?;
    for (i, (name, pts)) in lines.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(e)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(Some(path.clone()))
}
