//! Loading workflow definitions from `config/workflows/*.toml`.
//!
//! The only file-reading part of the coordinator's inputs; it lives outside the pure
//! `coordinator` tree. Each file holds one workflow definition at its top level. Every
//! error names the file, the workflow (once its name could be read) and the field.
//!
//! In: `coordinator.workflows_dir`. Out: the validated [`Workflows`], or a
//! [`WorkflowFileError`]. Guarantees: a directory of more than
//! [`MAX_WORKFLOW_FILES`] files, or a file over [`MAX_WORKFLOW_FILE_BYTES`],
//! is refused; files are read in name order; an unknown field is an error,
//! not ignored; a `(name, version)` defined twice names both files.

use std::fmt;
use std::path::Path;

use crate::coordinator::definition::{DefinitionError, Rule, WorkflowDefinition, Workflows};

/// Largest workflow file read, so a stray file cannot exhaust memory.
pub const MAX_WORKFLOW_FILE_BYTES: u64 = 1024 * 1024;
/// Most workflow files in one directory.
pub const MAX_WORKFLOW_FILES: usize = 1024;

/// A workflow file that cannot be read, parsed or validated.
///
/// Displays as `config/workflows/order.toml: workflow "order": step "b":
/// steps[1].retry.multiplier: [invalid] must be >= 1.0`: the file, the
/// workflow and the step when known, the field, the rule it breaks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct WorkflowFileError {
    /// The file (or directory) label.
    pub file: String,
    /// The workflow's `name`, when it could be read.
    pub workflow: Option<String>,
    /// The step's `name`, when the refusal is about one step (boxed, to
    /// keep the error small).
    pub step: Option<Box<str>>,
    /// The field path (`steps[1].retry.multiplier`) or TOML location (`line 3, column 1`).
    pub field: Option<String>,
    /// The rule the definition breaks; none when the file cannot be read.
    pub rule: Option<Rule>,
    pub message: String,
}

impl fmt::Display for WorkflowFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.file)?;
        if let Some(workflow) = &self.workflow {
            write!(f, "workflow \"{workflow}\": ")?;
        }
        if let Some(step) = &self.step {
            write!(f, "step \"{step}\": ")?;
        }
        if let Some(field) = &self.field {
            write!(f, "{field}: ")?;
        }
        if let Some(rule) = self.rule {
            write!(f, "[{}] ", rule.as_str())?;
        }
        f.write_str(&self.message)
    }
}

impl WorkflowFileError {
    fn new(file: &str, message: impl Into<String>) -> Self {
        Self {
            file: file.to_owned(),
            workflow: None,
            step: None,
            field: None,
            rule: None,
            message: message.into(),
        }
    }

    fn of_definition(file: &str, workflow: &str, e: DefinitionError) -> Self {
        Self {
            file: file.to_owned(),
            workflow: Some(workflow.to_owned()),
            step: e.step.map(String::into_boxed_str),
            field: Some(e.field),
            rule: Some(e.rule),
            message: e.message,
        }
    }
}

/// Reads every `*.toml` file of `dir` (sorted by name, not recursive) into a validated
/// registry. A missing directory, an unreadable or invalid file and a `(name, version)`
/// defined twice are errors. An empty directory yields an empty registry.
pub fn load_dir(dir: &Path) -> Result<Workflows, WorkflowFileError> {
    let dir_label = dir.display().to_string();
    let entries = std::fs::read_dir(dir).map_err(|e| {
        WorkflowFileError::new(&dir_label, format!("cannot read workflow directory: {e}"))
    })?;
    let mut paths = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| {
            WorkflowFileError::new(&dir_label, format!("cannot list directory: {e}"))
        })?;
        let path = entry.path();
        if path.extension().is_some_and(|ext| ext == "toml") && path.is_file() {
            paths.push(path);
        }
    }
    if paths.len() > MAX_WORKFLOW_FILES {
        return Err(WorkflowFileError::new(
            &dir_label,
            format!("more than {MAX_WORKFLOW_FILES} workflow files"),
        ));
    }
    paths.sort();
    let mut definitions: Vec<(String, WorkflowDefinition)> = Vec::with_capacity(paths.len());
    for path in paths {
        let label = path.display().to_string();
        let text =
            read_bounded(&path).map_err(|message| WorkflowFileError::new(&label, message))?;
        let def = parse_str(&label, &text)?;
        if let Some(error) = defined_before(&definitions, &label, &def) {
            return Err(error);
        }
        definitions.push((label, def));
    }
    let labels: Vec<(String, String, u32)> = definitions
        .iter()
        .map(|(label, d)| (label.clone(), d.name.clone(), d.version))
        .collect();
    let workflows = Workflows::each_valid(definitions.into_iter().map(|(_, d)| d).collect())
        .map_err(|e| WorkflowFileError::new(&dir_label, e.to_string()))?;
    match workflows.check_children().into_iter().next() {
        Some(((name, version), e)) => {
            let file = labels
                .iter()
                .find(|(_, n, v)| *n == name && *v == version)
                .map_or(dir_label.as_str(), |(label, _, _)| label.as_str());
            Err(WorkflowFileError::of_definition(file, &name, e))
        }
        None => Ok(workflows),
    }
}

/// The refusal of `def` (in `label`) when one of `earlier` has its name
/// and version.
fn defined_before(
    earlier: &[(String, WorkflowDefinition)],
    label: &str,
    def: &WorkflowDefinition,
) -> Option<WorkflowFileError> {
    let (first, _) = earlier
        .iter()
        .find(|(_, d)| d.name == def.name && d.version == def.version)?;
    Some(WorkflowFileError {
        file: label.to_owned(),
        workflow: Some(def.name.clone()),
        step: None,
        field: Some("version".to_owned()),
        rule: Some(Rule::DuplicateVersion),
        message: format!("version {} is already defined in {first}", def.version),
    })
}

/// `ductor workflows check`: each file read, parsed and validated as
/// `serve` would load it, and checked against the files before it for a
/// name and version defined twice; one outcome per file, in order.
pub fn check_files(
    paths: &[std::path::PathBuf],
) -> Vec<Result<WorkflowDefinition, WorkflowFileError>> {
    let mut loaded: Vec<(String, WorkflowDefinition)> = Vec::new();
    let mut outcomes = Vec::with_capacity(paths.len());
    for path in paths {
        let label = path.display().to_string();
        let outcome = read_bounded(path)
            .map_err(|message| WorkflowFileError::new(&label, message))
            .and_then(|text| parse_str(&label, &text))
            .and_then(|def| match defined_before(&loaded, &label, &def) {
                Some(error) => Err(error),
                None => Ok(def),
            });
        if let Ok(def) = &outcome {
            loaded.push((label, def.clone()));
        }
        outcomes.push(outcome);
    }
    refuse_children(&mut outcomes, paths);
    outcomes
}

/// Refuses each file whose `child` steps start a workflow that none of
/// the files defines, or start each other without end: the files checked
/// together are the set `serve` would load.
fn refuse_children(
    outcomes: &mut [Result<WorkflowDefinition, WorkflowFileError>],
    paths: &[std::path::PathBuf],
) {
    let defined: Vec<WorkflowDefinition> = outcomes.iter().flatten().cloned().collect();
    let Ok(workflows) = Workflows::each_valid(defined) else {
        return;
    };
    for ((name, version), e) in workflows.check_children() {
        let at = outcomes.iter().position(|o| {
            o.as_ref()
                .is_ok_and(|d| d.name == name && d.version == version)
        });
        if let Some(at) = at {
            let file = paths[at].display().to_string();
            outcomes[at] = Err(WorkflowFileError::of_definition(&file, &name, e));
        }
    }
}

fn read_bounded(path: &Path) -> Result<String, String> {
    let len = std::fs::metadata(path)
        .map_err(|e| format!("cannot read file: {e}"))?
        .len();
    if len > MAX_WORKFLOW_FILE_BYTES {
        return Err(format!(
            "file is {len} bytes, limit is {MAX_WORKFLOW_FILE_BYTES}"
        ));
    }
    std::fs::read_to_string(path).map_err(|e| format!("cannot read file: {e}"))
}

/// Parses and validates one workflow definition; `file_label` names it in errors.
pub fn parse_str(file_label: &str, text: &str) -> Result<WorkflowDefinition, WorkflowFileError> {
    let def: WorkflowDefinition = toml::from_str(text).map_err(|e| {
        let message = e.message().trim().to_owned();
        let rule = if message.starts_with("unknown field") {
            Rule::UnknownField
        } else {
            Rule::Syntax
        };
        WorkflowFileError {
            workflow: name_of(text),
            field: e.span().map(|span| location(text, span.start)),
            rule: Some(rule),
            ..WorkflowFileError::new(file_label, message)
        }
    })?;
    def.validate()
        .map_err(|e| WorkflowFileError::of_definition(file_label, &def.name, e))?;
    Ok(def)
}

/// The top-level `name` of a file that did not deserialize, if it parses as TOML at all.
fn name_of(text: &str) -> Option<String> {
    let table: toml::Table = toml::from_str(text).ok()?;
    table.get("name")?.as_str().map(str::to_owned)
}

/// `steps[1].retry.multiplier (line L, column C)` for a byte offset: the location is
/// exact, the key path a best-effort reading of the table headers above the line.
fn location(text: &str, offset: usize) -> String {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    match key_path(text, line_start) {
        Some(path) => format!("{path} (line {line}, column {column})"),
        None => format!("line {line}, column {column}"),
    }
}

/// The dotted key of the `key = value` line starting at `line_start`, prefixed by the
/// table header in force there; arrays of tables are indexed (`steps[1]`).
fn key_path(text: &str, line_start: usize) -> Option<String> {
    let line = text.get(line_start..)?.lines().next()?;
    let key = line.split_once('=')?.0.trim();
    if key.is_empty() || key.starts_with('[') {
        return None;
    }
    let mut counts: Vec<(String, usize)> = Vec::new();
    let mut header = String::new();
    for l in text.get(..line_start)?.lines().map(str::trim) {
        if let Some(name) = l
            .strip_prefix("[[")
            .and_then(|r| r.split_once("]]"))
            .map(|(n, _)| n.trim())
        {
            let count = match counts.iter_mut().find(|(n, _)| n == name) {
                Some((_, c)) => {
                    *c += 1;
                    *c
                }
                None => {
                    counts.push((name.to_owned(), 1));
                    1
                }
            };
            header = format!("{}[{}]", indexed(name, &counts, name), count - 1);
        } else if let Some(name) = l
            .strip_prefix('[')
            .and_then(|r| r.split_once(']'))
            .map(|(n, _)| n.trim())
        {
            header = indexed(name, &counts, "");
        }
    }
    Some(if header.is_empty() {
        key.to_owned()
    } else {
        format!("{header}.{key}")
    })
}

/// `steps.retry` -> `steps[1].retry` when `steps` is an array of tables seen twice;
/// `skip` (the array being opened) is left unindexed.
fn indexed(name: &str, counts: &[(String, usize)], skip: &str) -> String {
    let mut out = String::new();
    let mut prefix = String::new();
    for part in name.split('.') {
        if !prefix.is_empty() {
            prefix.push('.');
            out.push('.');
        }
        prefix.push_str(part.trim());
        out.push_str(part.trim());
        if prefix != skip
            && let Some((_, c)) = counts.iter().find(|(n, _)| *n == prefix)
        {
            out.push_str(&format!("[{}]", c - 1));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "order"
version = 2
[[steps]]
name = "a"
pool = "default"
timeout_ms = 1000
[[steps]]
name = "b"
pool = "default"
timeout_ms = 1000
[steps.retry]
multiplier = 0.5
"#;

    fn temp_dir(tag: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("ductor-workflows-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn validation_error_names_file_workflow_and_field() {
        let err = parse_str("config/workflows/order.toml", GOOD).unwrap_err();
        assert_eq!(
            err.to_string(),
            "config/workflows/order.toml: workflow \"order\": step \"b\": steps[1].retry.multiplier: [invalid] must be >= 1.0"
        );
    }

    #[test]
    fn toml_errors_name_file_workflow_and_location() {
        let text = GOOD.replace("multiplier = 0.5", "multiplier = \"fast\"");
        let err = parse_str("order.toml", &text).unwrap_err();
        assert_eq!(err.workflow.as_deref(), Some("order"));
        assert_eq!(
            err.field.as_deref(),
            Some("steps[1].retry.multiplier (line 13, column 14)")
        );
        assert!(err.message.contains("invalid type"), "{err}");
        println!("{err}");
        let text = GOOD.replace(
            "timeout_ms = 1000\n[[steps]]",
            "timeout_ms = 1000\ncolour = 1\n[[steps]]",
        );
        let err = parse_str("order.toml", &text).unwrap_err();
        assert!(err.message.contains("unknown field `colour`"), "{err}");
        assert_eq!(
            err.field.as_deref(),
            Some("steps[0].colour (line 8, column 1)")
        );
        let err = parse_str("x.toml", "name = ").unwrap_err();
        assert_eq!(err.workflow, None);
        assert!(err.to_string().starts_with("x.toml: name (line 1"), "{err}");
    }

    #[test]
    fn shipped_example_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/workflows/example.toml");
        let text = std::fs::read_to_string(path).unwrap();
        let def = parse_str("example.toml", &text).unwrap();
        assert_eq!(def.name, "example");
        assert_eq!(def.steps.len(), 3);
        assert_eq!(def.steps[1].retry.max_attempts, 8);
        assert_eq!(def.output_topic.as_deref(), Some("ductor.outputs"));
    }

    #[test]
    fn load_dir_reads_sorted_toml_files_and_rejects_duplicates() {
        let dir = temp_dir("load");
        let good = GOOD.replace("multiplier = 0.5", "multiplier = 1.5");
        std::fs::write(dir.join("a.toml"), &good).unwrap();
        std::fs::write(
            dir.join("b.toml"),
            good.replace("version = 2", "version = 3"),
        )
        .unwrap();
        std::fs::write(dir.join("notes.txt"), "not toml").unwrap();
        std::fs::create_dir_all(dir.join("nested.toml")).unwrap();
        let wf = load_dir(&dir).unwrap();
        assert_eq!(wf.len(), 2);
        assert_eq!(wf.latest("order").unwrap().version, 3);
        std::fs::write(dir.join("c.toml"), &good).unwrap();
        let err = load_dir(&dir).unwrap_err();
        assert!(err.file.ends_with("c.toml"), "{err}");
        assert_eq!(err.field.as_deref(), Some("version"));
        assert!(err.message.contains("a.toml"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_directory_is_an_error_naming_it() {
        let err = load_dir(Path::new("/nonexistent/ductor/workflows")).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("/nonexistent/ductor/workflows: cannot read"),
            "{err}"
        );
    }
}
