// Package kubewatch is the grpc-go reference server's Kubernetes source: LIST,
// then WATCH, of the labelled job-summary ConfigMaps of one namespace, over
// plain HTTP/1.1 with JSON (one watch event per line), turned into job events
// the way a ClusterD-style job cache would: a job's slices (one ConfigMap per
// cm_index) are put back together into one rank table, and one event goes out
// per change of a complete job, none for a rewrite that changes nothing.
//
// Kept simple on purpose, but not slow: a job held in one ConfigMap passes its
// hccl.json through as it is; a job split over several has each slice's
// hccl.json parsed once per change of that slice (top-level keys only) and
// its server_list arrays spliced together as text. Nothing is validated
// beyond what that needs (the benchmark's input is well formed); jobsignal's
// own store does more (strict JSON, bounds), which the figures include.
package kubewatch

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Selector is the label selector of job-summary ConfigMaps.
const Selector = "outside-job-info=true"

// Job is one job event: JobSummarySignal's fields but uuid, by proto field name.
type Job struct {
	Key                                             string // namespace/job_id
	JobID, JobName, Namespace, FrameWork, JobStatus string
	Time, CmIndex, Total, HcclJSON, DeleteTime      string
	SharedTorIP, MasterAddr, Operator, Sid          string
}

// Publish receives every job event, in order, on the watcher's goroutine.
type Publish func(Job)

type metadata struct {
	Name            string `json:"name"`
	Namespace       string `json:"namespace"`
	ResourceVersion string `json:"resourceVersion"`
}

// object is a ConfigMap, a bookmark (metadata only) or a Status (code).
type object struct {
	Metadata metadata          `json:"metadata"`
	Data     map[string]string `json:"data"`
	Code     int               `json:"code"`
}

type event struct {
	Type   string `json:"type"`
	Object object `json:"object"`
}

type list struct {
	Metadata metadata `json:"metadata"`
	Items    []object `json:"items"`
}

// slice is one ConfigMap of a job; its hccl.json split lazily (several slices only).
type slice struct {
	name    string
	data    map[string]string
	parsed  bool
	header  map[string]json.RawMessage
	servers []byte // the inside of server_list's brackets
}

type job struct {
	slices map[int]*slice
	last   *Job // what was last published (nil: nothing yet)
}

// Watcher keeps the jobs of one namespace and publishes their changes.
type Watcher struct {
	base      string
	namespace string
	publish   Publish
	client    *http.Client

	version string
	jobs    map[string]*job
	where   map[string]string // ConfigMap name -> job key
	Events  int64             // watch events read (only the watcher's goroutine writes it)
}

// New makes a Watcher of `namespace` at the API server `base` (http://host:port).
func New(base, namespace string, publish Publish) *Watcher {
	return &Watcher{
		base: base, namespace: namespace, publish: publish,
		client: &http.Client{Transport: &http.Transport{DisableCompression: true}},
		jobs:   map[string]*job{}, where: map[string]string{},
	}
}

func (w *Watcher) url(params url.Values) string {
	params.Set("labelSelector", Selector)
	return fmt.Sprintf("%s/api/v1/namespaces/%s/configmaps?%s", w.base, url.PathEscape(w.namespace), params.Encode())
}

// List loads every ConfigMap (a relist publishes only the differences).
func (w *Watcher) List() error {
	response, err := w.client.Get(w.url(url.Values{}))
	if err != nil {
		return err
	}
	defer response.Body.Close()
	if response.StatusCode != http.StatusOK {
		return fmt.Errorf("LIST: HTTP %d", response.StatusCode)
	}
	var listed list
	if err := json.NewDecoder(response.Body).Decode(&listed); err != nil {
		return fmt.Errorf("LIST: %v", err)
	}
	seen := map[string]bool{}
	touched := map[string]bool{}
	for i := range listed.Items {
		seen[listed.Items[i].Metadata.Name] = true
		if key := w.put(&listed.Items[i]); key != "" {
			touched[key] = true
		}
	}
	for name := range w.where {
		if !seen[name] {
			touched[w.remove(name)] = true
		}
	}
	keys := make([]string, 0, len(touched))
	for key := range touched {
		keys = append(keys, key)
	}
	sort.Strings(keys)
	for _, key := range keys {
		w.settle(key)
	}
	w.version = listed.Metadata.ResourceVersion
	return nil
}

// Run watches from the LIST's version until the process ends: a watch that ends
// is resumed from the last version; an ERROR event (410) or a failure relists.
func (w *Watcher) Run() {
	for {
		relist, err := w.watch()
		if err != nil || relist {
			if err != nil {
				time.Sleep(time.Second)
			}
			for w.List() != nil {
				time.Sleep(time.Second)
			}
		}
	}
}

func (w *Watcher) watch() (bool, error) {
	params := url.Values{}
	params.Set("watch", "true")
	params.Set("resourceVersion", w.version)
	params.Set("allowWatchBookmarks", "true")
	params.Set("timeoutSeconds", "300")
	response, err := w.client.Get(w.url(params))
	if err != nil {
		return false, err
	}
	defer response.Body.Close()
	if response.StatusCode == http.StatusGone {
		return true, nil
	}
	if response.StatusCode != http.StatusOK {
		return false, fmt.Errorf("WATCH: HTTP %d", response.StatusCode)
	}
	decoder := json.NewDecoder(response.Body)
	for {
		var e event
		if err := decoder.Decode(&e); err != nil {
			if err == io.EOF {
				return false, nil
			}
			return false, err
		}
		w.Events++
		switch e.Type {
		case "ERROR":
			return true, nil
		case "BOOKMARK":
		case "ADDED", "MODIFIED":
			if key := w.put(&e.Object); key != "" {
				w.settle(key)
			}
		case "DELETED":
			if _, ok := w.where[e.Object.Metadata.Name]; ok {
				w.settle(w.remove(e.Object.Metadata.Name))
			}
		}
		if v := e.Object.Metadata.ResourceVersion; v != "" {
			w.version = v
		}
	}
}

// put stores a ConfigMap as a slice of its job; the job's key ("" if unusable).
func (w *Watcher) put(o *object) string {
	name := o.Metadata.Name
	index, err := strconv.Atoi(o.Data["cm_index"])
	if err != nil || o.Data["job_id"] == "" {
		if _, ok := w.where[name]; ok {
			w.settle(w.remove(name))
		}
		return ""
	}
	key := o.Metadata.Namespace + "/" + o.Data["job_id"]
	if old, ok := w.where[name]; ok && old != key {
		w.settle(w.remove(name))
	}
	j := w.jobs[key]
	if j == nil {
		j = &job{slices: map[int]*slice{}}
		w.jobs[key] = j
	}
	for i, s := range j.slices { // a ConfigMap that changed its cm_index
		if s.name == name && i != index {
			delete(j.slices, i)
		}
	}
	j.slices[index] = &slice{name: name, data: o.Data}
	w.where[name] = key
	return key
}

// remove forgets a ConfigMap; its job's key.
func (w *Watcher) remove(name string) string {
	key := w.where[name]
	delete(w.where, name)
	if j := w.jobs[key]; j != nil {
		for i, s := range j.slices {
			if s.name == name {
				delete(j.slices, i)
			}
		}
	}
	return key
}

// settle publishes the job's state if it is complete and differs from the last
// one published, or a delete if it lost a ConfigMap after being published.
func (w *Watcher) settle(key string) {
	j := w.jobs[key]
	if j == nil {
		return
	}
	current, complete := w.assemble(key, j)
	if !complete {
		if len(j.slices) == 0 {
			delete(w.jobs, key)
		}
		if j.last != nil && j.last.Operator != "delete" && len(j.slices) < countOf(j.last.Total) {
			gone := *j.last
			gone.Operator = "delete"
			j.last = &gone
			w.publish(gone)
		}
		return
	}
	if j.last != nil && *j.last == current {
		return
	}
	j.last = &current
	w.publish(current)
}

// The data keys every slice of a job repeats (all but cm_index and hccl.json).
var jobFields = [...]string{
	"job_id", "job_name", "framework", "job_status", "total", "operator", "time",
	"deleteTime", "sharedTorIp", "masterAddr", "sid",
}

func countOf(total string) int {
	n, err := strconv.Atoi(total)
	if err != nil {
		return 1
	}
	return n
}

func (w *Watcher) assemble(key string, j *job) (Job, bool) {
	first := j.slices[0]
	if first == nil {
		return Job{}, false
	}
	total := countOf(first.data["total"])
	if total < 1 || len(j.slices) != total {
		return Job{}, false
	}
	// Every slice from the same write of the job: ClusterD rewrites them all.
	for i := 0; i < total; i++ {
		s := j.slices[i]
		if s == nil {
			return Job{}, false
		}
		for _, field := range jobFields {
			if s.data[field] != first.data[field] {
				return Job{}, false
			}
		}
	}
	d := first.data
	hccl := d["hccl.json"]
	if total > 1 {
		joined, ok := join(j, total)
		if !ok {
			return Job{}, false
		}
		hccl = joined
	}
	return Job{
		Key: key, JobID: d["job_id"], JobName: d["job_name"], Namespace: key[:strings.IndexByte(key, '/')],
		FrameWork: d["framework"], JobStatus: d["job_status"], Time: d["time"], CmIndex: "0",
		Total: d["total"], HcclJSON: hccl, DeleteTime: d["deleteTime"],
		SharedTorIP: d["sharedTorIp"], MasterAddr: d["masterAddr"], Operator: d["operator"],
		Sid: d["sid"],
	}, true
}

// join puts a job's rank table back together: slice 0's keys, every slice's servers.
func join(j *job, total int) (string, bool) {
	var servers [][]byte
	for i := 0; i < total; i++ {
		s := j.slices[i]
		if !s.parsed {
			s.parsed = true
			if json.Unmarshal([]byte(s.data["hccl.json"]), &s.header) == nil {
				list := bytes.TrimSpace(s.header["server_list"])
				if len(list) >= 2 && list[0] == '[' {
					s.servers = bytes.TrimSpace(list[1 : len(list)-1])
				}
			}
		}
		if s.header == nil {
			return "", false
		}
		if len(s.servers) > 0 {
			servers = append(servers, s.servers)
		}
	}
	header := j.slices[0].header
	keys := make([]string, 0, len(header))
	for key := range header {
		keys = append(keys, key)
	}
	sort.Strings(keys)
	var out bytes.Buffer
	out.WriteByte('{')
	for n, key := range keys {
		if n > 0 {
			out.WriteByte(',')
		}
		quoted, _ := json.Marshal(key)
		out.Write(quoted)
		out.WriteByte(':')
		if key == "server_list" {
			out.WriteByte('[')
			out.Write(bytes.Join(servers, []byte{','}))
			out.WriteByte(']')
		} else {
			out.Write(header[key])
		}
	}
	out.WriteByte('}')
	return out.String(), true
}
