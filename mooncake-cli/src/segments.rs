//! `GET /get_all_segments` on the master's metrics listener, as the reference's master
//! answers it: the name of every mounted segment, one per line (each line ends in
//! `\n`), `text/plain; version=0.0.4`; an empty body while no segment is mounted
//! (SGLang polls it until it is not empty before it starts).

use mooncake_core::MasterStats;

/// Content type of the answer (the reference's).
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4";

/// The body of `/get_all_segments` for a master with these stats.
pub fn all_segments_text(stats: &MasterStats) -> String {
    let mut body = String::new();
    for s in &stats.segment_usage {
        body.push_str(&s.name);
        body.push('\n');
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_core::SegmentUsage;

    #[test]
    fn one_name_per_line_and_empty_without_segments() {
        assert_eq!(all_segments_text(&MasterStats::default()), "");
        let stats = MasterStats {
            segment_usage: vec![
                SegmentUsage { segment: 1, name: "127.0.0.1:1#1".into(), ..Default::default() },
                SegmentUsage { segment: 2, name: "127.0.0.1:2#1".into(), ..Default::default() },
            ],
            ..Default::default()
        };
        assert_eq!(all_segments_text(&stats), "127.0.0.1:1#1\n127.0.0.1:2#1\n");
    }
}
