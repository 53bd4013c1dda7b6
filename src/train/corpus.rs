//! The embedded default corpus: about 300 KB of simple English prose that the
//! project generates itself, deterministically, from the word lists and
//! sentence patterns below (a Philox stream with a fixed seed picks every
//! choice). No download, no external file: `tinyllm train` with no arguments
//! trains on this.
//!
//! The text is made to be learnable by a small byte-level model in minutes:
//! a closed vocabulary, recurring sentence shapes, dialogue, counting and
//! small sums — so the loss falls visibly and samples soon look like words.

use crate::rng::Generator;
use std::sync::OnceLock;

/// Bytes the generator stops at (the end of the paragraph that crosses it).
pub const TARGET_BYTES: usize = 300_000;
const SEED: u64 = 0x7131_11a0_c0de;

const NAMES: &[&str] = &[
    "Ada", "Ben", "Cora", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivo", "June", "Kit", "Lena",
    "Milo", "Nora", "Otto", "Pia", "Quin", "Rosa", "Sam", "Tess", "Uma", "Vic", "Wren", "Yara",
    "Zed",
];
const ANIMALS: &[&str] = &[
    "fox", "cat", "dog", "owl", "bear", "hare", "crow", "goat", "mouse", "horse", "duck", "frog",
    "wolf", "deer", "lamb", "seal", "bee", "crab", "swan", "mole",
];
const THINGS: &[&str] = &[
    "lamp", "book", "stone", "cup", "key", "map", "coat", "boat", "bell", "box", "kite", "drum",
    "ring", "rope", "shell", "loaf", "hat", "chair", "clock", "basket", "letter", "candle",
    "spoon", "ladder", "blanket",
];
const ADJS: &[&str] = &[
    "little", "old", "red", "quiet", "bright", "small", "green", "warm", "cold", "tall", "round",
    "brave", "sleepy", "happy", "clever", "heavy", "soft", "blue", "golden", "dusty", "tiny",
    "gentle", "wild", "wooden", "silver",
];
const PLACES: &[&str] = &[
    "river", "garden", "forest", "market", "hill", "village", "kitchen", "harbor", "meadow",
    "library", "bridge", "tower", "orchard", "valley", "station", "school", "farm", "lake",
    "mountain", "square",
];
const MOVES: &[&str] = &[
    "walked", "ran", "hurried", "wandered", "climbed", "sailed", "rode", "crept", "danced",
    "drifted", "marched", "raced",
];
const ACTS: &[&str] = &[
    "found",
    "lost",
    "carried",
    "painted",
    "mended",
    "opened",
    "dropped",
    "hid",
    "shared",
    "washed",
    "counted",
    "sold",
    "bought",
    "lifted",
    "kept",
    "gave away",
];
const TIMES: &[&str] = &[
    "In the morning",
    "At noon",
    "In the evening",
    "At night",
    "On Monday",
    "On a rainy day",
    "Before dinner",
    "After school",
    "Long ago",
    "One summer",
    "In the winter",
    "At dawn",
];
const FEELS: &[&str] = &[
    "glad",
    "tired",
    "hungry",
    "curious",
    "proud",
    "sad",
    "calm",
    "surprised",
    "worried",
    "cheerful",
];
const WEATHER: &[&str] = &[
    "The sun was shining",
    "The wind was blowing",
    "Rain fell softly",
    "Snow covered the ground",
    "The sky was gray",
    "Fog hid the hills",
    "The air smelled of bread",
    "Stars filled the sky",
];
const SAYS: &[&str] = &[
    "said",
    "asked",
    "called",
    "whispered",
    "laughed",
    "answered",
];
const NUMS: &[&str] = &[
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
];

/// A small helper over the generator: picks from lists.
struct Pick<'a>(&'a Generator);

impl Pick<'_> {
    fn n(&self, n: usize) -> usize {
        self.0.below(n)
    }
    fn of<'w>(&self, xs: &[&'w str]) -> &'w str {
        xs[self.n(xs.len())]
    }
    fn article(&self, word: &str) -> &'static str {
        match word.as_bytes()[0] {
            b'a' | b'e' | b'i' | b'o' | b'u' => "an",
            _ => "a",
        }
    }
}

fn cap(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

fn sentence(p: &Pick) -> String {
    let name = p.of(NAMES);
    let animal = p.of(ANIMALS);
    let thing = p.of(THINGS);
    let adj = p.of(ADJS);
    let place = p.of(PLACES);
    match p.n(12) {
        0 => format!("The {adj} {animal} {} to the {place}.", p.of(MOVES)),
        1 => format!(
            "{name} {} {} {adj} {thing} near the {place}.",
            p.of(ACTS),
            p.article(adj)
        ),
        2 => format!(
            "{} {name} {} to the {place} with the {animal}.",
            p.of(TIMES),
            p.of(MOVES)
        ),
        3 => format!("{}, and the {animal} felt {}.", p.of(WEATHER), p.of(FEELS)),
        4 => format!(
            "\"Where is my {thing}?\" {} {name}. \"It is in the {place},\" {} {}.",
            p.of(SAYS),
            p.of(SAYS),
            p.of(NAMES)
        ),
        5 => {
            let (a, b) = (p.n(10), p.n(9));
            format!("{} plus {} is {}.", cap(NUMS[a]), NUMS[b], NUMS[a + b])
        }
        6 => {
            let n = 2 + p.n(8);
            format!(
                "{name} counted {} {}s: {}.",
                NUMS[n],
                thing,
                (1..=n).map(|i| NUMS[i]).collect::<Vec<_>>().join(", ")
            )
        }
        7 => format!(
            "The {thing} was {adj}, and the {} {animal} liked it.",
            p.of(ADJS)
        ),
        8 => format!(
            "{name} gave the {thing} to {}, who was {}.",
            p.of(NAMES),
            p.of(FEELS)
        ),
        9 => format!(
            "\"Good {},\" {} {name} to the {animal}.",
            ["morning", "evening", "night", "day"][p.n(4)],
            p.of(SAYS)
        ),
        10 => format!(
            "At the {place} there was {} {adj} {thing} and {} {animal}.",
            p.article(adj),
            p.article(animal)
        ),
        _ => format!(
            "{} {name} was {}, so {name} {} home.",
            p.of(TIMES),
            p.of(FEELS),
            p.of(MOVES)
        ),
    }
}

fn generate() -> String {
    let gen = Generator::new(SEED);
    let p = Pick(&gen);
    let mut out = String::with_capacity(TARGET_BYTES + 4096);
    let mut chapter = 1;
    while out.len() < TARGET_BYTES {
        if p.n(12) == 0 || out.is_empty() {
            out.push_str(&format!("Chapter {chapter}\n\n"));
            chapter += 1;
        }
        let k = 3 + p.n(5);
        let para: Vec<String> = (0..k).map(|_| sentence(&p)).collect();
        out.push_str(&para.join(" "));
        out.push_str("\n\n");
    }
    out
}

/// The embedded corpus (generated on first use, then cached).
pub fn default_text() -> &'static str {
    static TEXT: OnceLock<String> = OnceLock::new();
    TEXT.get_or_init(generate)
}

#[cfg(test)]
mod tests {
    #[test]
    fn corpus_is_deterministic_ascii_and_sized() {
        let a = super::generate();
        assert_eq!(a, super::generate());
        assert!(a.len() >= super::TARGET_BYTES && a.len() < super::TARGET_BYTES + 4096);
        assert!(a.is_ascii());
        assert!(a.starts_with("Chapter 1\n\n"));
    }
}
