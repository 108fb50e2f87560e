import { Sandbox } from "forkd";

const sbx = await Sandbox.create("python");              // a child of the python template
const r = await sbx.commands.run("echo hi; exit 3");      // { exitCode, stdout, stderr, stdoutBytes, ... }
await sbx.files.write("/root/data.csv", "a,b\n1,2\n");
const x = await sbx.runCode("import pandas as pd; pd.read_csv('/root/data.csv')", {
  onStdout: (t) => process.stdout.write(t),
});
console.log(x.results[0]?.html);
const snap = await sbx.branch();                          // snapshot it while it runs on
const children = await snap.fork(3);                      // three children with its state
await Promise.all(children.map((c) => c.kill()));
await sbx.kill();
